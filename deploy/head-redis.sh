#!/usr/bin/env bash
# The deployment's redis-server on the head of a `ray up` cluster, a service of its own: started
# by the head start commands (deploy/cluster.yaml) before `ray start --head`, whose GCS keeps its
# tables in it (Ray's GCS fault tolerance: a GCS that restarts finds its actors, placement groups
# and nodes again), and used by `disagg serve --cluster` (deploy/head-serve.sh hands it the URL) as
# the deployment's registry. No process's child: neither `disagg serve` nor Ray dying takes it
# along. Its data is on disk (appendonly), so a redis-server that dies comes back, restarted by
# this script's loop, with Ray's tables. It stops by itself once Ray on the head is gone
# (`ray down`, `ray stop`), not when only the GCS restarts.
#
#   deploy/head-redis.sh start      stop the one running, then start one, empty (a new cluster)
#   deploy/head-redis.sh stop       stop it
#   deploy/head-redis.sh address    HOST:PORT, for RAY_REDIS_ADDRESS
#   deploy/head-redis.sh password   its password, for `ray start --redis-password`
#
# It listens on this node's IP as Ray sees it (workers on other nodes heartbeat to it) on
# $DISAGG_HEAD_REDIS_PORT (6380: Ray's GCS has 6379), behind a password made at start. Its files,
# owner-only: ~/disagg-redis (config, password, URL, append-only files, log).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=~/disagg-redis
PORT=${DISAGG_HEAD_REDIS_PORT:-6380}
LOOP_PID=$DIR/loop.pid
GONE_CHECKS=5  # two-second checks in a row without Ray on the head before it stops

node_ip() {
    .venv/bin/python -c 'import ray._private.services as s; print(s.get_node_ip_address())'
}

write_config() {
    local ip=$1 password
    password=$(.venv/bin/python -c 'import secrets; print(secrets.token_hex(16))')
    (
        umask 077
        printf '%s\n' "$password" >"$DIR/password"
        printf '%s:%s\n' "$ip" "$PORT" >"$DIR/address"
        printf 'redis://:%s@%s:%s/0\n' "$password" "$ip" "$PORT" >"$DIR/url"
        cat >"$DIR/redis.conf" <<EOF
bind $ip
port $PORT
dir $DIR/data
appendonly yes
appendfsync everysec
save ""
daemonize no
loglevel warning
logfile $DIR/redis.log
requirepass "$password"
EOF
    )
}

ray_on_head() {
    # The head's raylet (Ray gives it --head) or its GCS: a GCS restarting alone leaves the raylet.
    pgrep -f '[g]cs_server' >/dev/null || pgrep -f '[r]aylet.* --head' >/dev/null
}

# The service: redis-server, restarted whenever it exits, until Ray on the head has come and gone
# (or its files have: then nothing of it may stay either).
loop() {
    local address seen_ray=0 gone=0
    address=$(cat "$DIR/address")
    while [ -d "$DIR" ]; do
        if ray_on_head; then
            seen_ray=1 gone=0
        elif [ "$seen_ray" = 1 ] && [ $((gone += 1)) -ge "$GONE_CHECKS" ]; then
            echo "$(date -u +%FT%TZ) Ray on the head is gone: stopping redis-server" >>"$DIR/redis.log"
            break
        fi
        if ! pgrep -f "[r]edis-server $address" >/dev/null; then
            setsid redis-server "$DIR/redis.conf" </dev/null >>"$DIR/redis.log" 2>&1 &
        fi
        sleep 2
    done
    stop_server "$address"
    rm -f "$LOOP_PID"
}

stop_server() {
    local pattern="[r]edis-server $1"
    [ -n "$1" ] || return 0
    pkill -TERM -f "$pattern" || return 0
    for _ in $(seq 20); do
        pgrep -f "$pattern" >/dev/null || return 0
        sleep 0.5
    done
    pkill -KILL -f "$pattern" || true
}

stop() {
    if [ -f "$LOOP_PID" ]; then
        kill -TERM "$(cat "$LOOP_PID")" 2>/dev/null || true
        rm -f "$LOOP_PID"
    fi
    stop_server "$(cat "$DIR/address" 2>/dev/null)"
}

start() {
    stop
    rm -rf "$DIR"
    mkdir -m 700 -p "$DIR/data"
    write_config "$(node_ip)"
    # By its whole path: `ps` tells which checkout's service it is.
    nohup setsid "$PWD/deploy/head-redis.sh" loop </dev/null >>"$DIR/redis.log" 2>&1 &
    echo $! >"$LOOP_PID"
    for _ in $(seq 50); do
        # The password in the environment, not on a command line where `ps` shows it.
        if REDISCLI_AUTH=$(cat "$DIR/password") redis-cli -h "$(cut -d: -f1 "$DIR/address")" -p "$PORT" \
            ping 2>/dev/null | grep -q PONG; then
            echo "redis-server for Ray's GCS and disagg on $(cat "$DIR/address"); log: $DIR/redis.log"
            return 0
        fi
        sleep 0.2
    done
    echo "redis-server did not answer on $(cat "$DIR/address"): $(tail -5 "$DIR/redis.log")" >&2
    exit 1
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    loop) loop ;;
    address) cat "$DIR/address" ;;
    password) cat "$DIR/password" ;;
    *) echo "usage: $0 [start|stop|address|password]" >&2; exit 2 ;;
esac
