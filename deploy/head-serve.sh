#!/usr/bin/env bash
# `disagg serve --cluster` on the head of a `ray up` cluster (deploy/cluster.yaml's head start
# commands run it): in the background, detached from the launcher's SSH session, logging to
# ~/disagg-serve.log; it writes its gRPC address to ~/disagg-serve.ready once it serves.
# With ~/disagg-plan.yaml (`disagg plan -o`), it serves that plan. With ~/disagg-api-key (a file
# holding the key, owner-only), clients must send that key: it reaches `disagg serve` in its
# environment ($DISAGG_API_KEY), never on a command line. With the head's redis-server
# (deploy/head-redis.sh, started before Ray, whose GCS keeps its tables there), it uses that Redis,
# whose URL it gets the same way ($DISAGG_REDIS_URL).
#
#   deploy/head-serve.sh start   stop the one running (it drains), then start
#   deploy/head-serve.sh stop    stop it
#
# It stops by itself when the cluster goes (`ray down`).
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=~/disagg-serve.log
READY=~/disagg-serve.ready
PLAN=~/disagg-plan.yaml
KEY_FILE=~/disagg-api-key
REDIS_URL_FILE=~/disagg-redis/url  # deploy/head-redis.sh writes it, owner-only
PATTERN='[d]isagg serve --cluster'  # [d]: pgrep must not find the shell that runs this

stop() {
    pkill -TERM -f "$PATTERN" || return 0
    for _ in $(seq 60); do
        pgrep -f "$PATTERN" >/dev/null || return 0
        sleep 1
    done
    pkill -KILL -f "$PATTERN" || true
}

start() {
    stop
    rm -f "$READY"
    local config=()
    [ -f "$PLAN" ] && config=(--config "$PLAN")
    if [ -f "$KEY_FILE" ]; then
        chmod 600 "$KEY_FILE"
        DISAGG_API_KEY=$(cat "$KEY_FILE")
        export DISAGG_API_KEY
    fi
    if [ -f "$REDIS_URL_FILE" ]; then
        DISAGG_REDIS_URL=$(cat "$REDIS_URL_FILE")
        export DISAGG_REDIS_URL
    fi
    # RAY_SCHEDULER_EVENTS=0: a driver takes the v1 autoscaler's events for v2's, fails to parse
    # them and logs a traceback for each (Ray 2.60).
    RAY_SCHEDULER_EVENTS=0 nohup setsid .venv/bin/disagg serve --cluster "${config[@]}" --ready-file "$READY" >"$LOG" 2>&1 </dev/null &
    echo "disagg serve --cluster ${config[*]} started on the head; log: $LOG"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 [start|stop]" >&2; exit 2 ;;
esac
