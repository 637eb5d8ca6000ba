"""`ray up` and `ray down` of deploy/cluster.yaml with Ray's real cluster launcher, as an operator
would run them: the file with only its FILL IN lines filled (three machines, which pool each
worker serves, the SSH user and key, the repository), a head at 127.0.0.1 and worker machines at
127.0.0.2 (prefill) and 127.0.0.3 (decode): loopback addresses of this one machine, reached over
SSH as root through the test's own SSH server. The machines clone this repository (its committed
HEAD) and run `make setup` in a directory of their own; the head serves the default model
disaggregated across the workers; a gRPC request is answered from 127.0.0.1; Ray's GCS keeps its
tables in the head's redis-server (deploy/head-redis.sh), which the deployment's registry is in
too, so that the GCS, killed and started again, finds the workers' actors alive and the
deployment answers on; `ray down` ends it all, that redis-server included; the test removes
everything the deployment installed or wrote.

Run alone (`make deploy-test`; CI runs it after `make test`): `ray stop` on a machine stops every
Ray on it. Skips, saying why, where no SSH server can run.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.ssh_server import SshServer, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
HEAD, PREFILL, DECODE = "127.0.0.1", "127.0.0.2", "127.0.0.3"
NAME = "disagg-deploy-test"  # the cluster's name and its directory on the machines
HOME = Path(pwd.getpwuid(os.getuid()).pw_dir)  # where SSH logs the user in, whatever $HOME says
# What the deployment writes in the SSH user's home (here: this user's), besides its directory.
HOME_FILES = [".bashrc", "ray_bootstrap_config.yaml", "ray_bootstrap_key.pem", "disagg-serve.log", "disagg-serve.ready"]
REDIS_DIR = HOME / "disagg-redis"  # deploy/head-redis.sh's files
REDIS_PORT = 6380  # deploy/head-redis.sh's
UP_TIMEOUT_S, SERVE_TIMEOUT_S, DOWN_TIMEOUT_S = 480, 360, 120

pytestmark = pytest.mark.timeout(900)


def filled_cluster_file(key: Path) -> str:
    """deploy/cluster.yaml with its FILL IN lines filled for this machine, and its directory and
    name made the test's own, so that nothing of a real deployment here is touched."""
    text = (REPO / "deploy" / "cluster.yaml").read_text()
    fills = {
        "head_ip: 10.0.0.1": f"head_ip: {HEAD}",
        "worker_ips: [10.0.0.2, 10.0.0.3]": f"worker_ips: [{PREFILL}, {DECODE}]",
        "ssh_user: ubuntu": "ssh_user: root",
        "ssh_private_key: ~/.ssh/id_ed25519": f"ssh_private_key: {key}",
        "https://github.com/your-org/disagg.git": str(REPO),
        "--prefill 10.0.0.2 --decode 10.0.0.3": f"--prefill {PREFILL} --decode {DECODE}",
        "cluster_name: disagg": f"cluster_name: {NAME}",
        # Two "machines" here share one /tmp: Ray names a node's sockets after the first free
        # name, checked but not taken, so two workers started at once can pick the same one and
        # the second raylet dies binding it. One worker start at a time.
        "RAY_AUTH_MODE=token RAY_worker_niceness=0 ~/disagg/.venv/bin/ray start --address": (
            f"flock /tmp/{NAME}-ray-start.lock env RAY_AUTH_MODE=token RAY_worker_niceness=0 "
            "~/disagg/.venv/bin/ray start --address"
        ),
    }
    for placeholder, value in fills.items():
        assert text.count(placeholder) == 1, f"deploy/cluster.yaml has no single '{placeholder}' to fill in"
        text = text.replace(placeholder, value)
    return re.sub(r"(?<=[/'])disagg(?=[/\s'])", NAME, text)  # ~/disagg -> ~/disagg-deploy-test


def run(args: list[str], timeout_s: float, log: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "HOME": str(HOME)}
    with open(log, "ab") as out:
        return subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, env=env, cwd=REPO)


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} does not exist)"


def our_processes() -> list[str]:
    """Processes of the deployment: its server, Ray's daemons and workers."""
    found = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
    patterns = (NAME, "disagg serve --cluster", "gcs_server", "raylet", "ray::")
    return [
        line.strip()
        for line in found
        if (any(p in line for p in patterns) or _is_head_redis(line)) and str(os.getpid()) != line.split()[0]
    ]


def _is_head_redis(ps_line: str) -> bool:
    """deploy/head-redis.sh's redis-server, which titles itself `redis-server HOST:PORT`."""
    return "redis-server" in ps_line and ps_line.rstrip().endswith(f":{REDIS_PORT}")


class HomeSnapshot:
    """The user's files that the deployment writes, put back as they were."""

    def __init__(self):
        self.saved = {name: (HOME / name).read_bytes() for name in HOME_FILES if (HOME / name).exists()}
        self.token = HOME / ".ray" / "auth_token"
        self.had_token = self.token.exists()
        self.tmp_before = set(os.listdir("/tmp"))
        self.had_redis_dir = REDIS_DIR.exists()

    def restore(self) -> None:
        for name in HOME_FILES:
            path = HOME / name
            if name in self.saved:
                path.write_bytes(self.saved[name])
            else:
                path.unlink(missing_ok=True)
        if not self.had_token:
            self.token.unlink(missing_ok=True)
        shutil.rmtree(HOME / NAME, ignore_errors=True)
        if not self.had_redis_dir:
            shutil.rmtree(REDIS_DIR, ignore_errors=True)
        for entry in set(os.listdir("/tmp")) - self.tmp_before:  # the launcher's SSH sockets and state
            if entry.startswith(("ray_ssh_", f"cluster-{NAME}", f"{NAME}-ray-start")):
                path = Path("/tmp") / entry
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def stop_leftovers() -> None:
    """After a failure: nothing of the deployment may outlive the test."""
    subprocess.run([str(VENV_BIN / "ray"), "stop", "--force"], capture_output=True, timeout=60)
    for line in our_processes():
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture
def ssh_server():
    if os.environ.get("DISAGG_DEPLOY_TEST") != "1":
        pytest.skip("runs alone, by `make deploy-test` (it stops every Ray on the machine)")
    reason = unavailable_reason([HEAD, PREFILL, DECODE])
    if reason is not None:
        pytest.skip(reason)
    if os.geteuid() != 0:
        pytest.skip("the SSH server of this test logs in as root: run it as root")
    if our_processes():
        pytest.fail(f"Ray or disagg already runs on this machine (`ray stop` would end it): {our_processes()[:3]}")
    server = SshServer([HEAD, PREFILL, DECODE]).start()
    try:
        yield server
    finally:
        server.stop()


def test_ray_up_serves_the_default_model_across_the_cluster_and_ray_down_ends_it(ssh_server, tmp_path):
    from disagg.client import DisaggClient, generate_request

    home = HomeSnapshot()
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(filled_cluster_file(ssh_server.client_key))
    log = tmp_path / "launcher.log"
    up = down = None
    try:
        if not home.had_token:  # the operator's one-time step (README)
            assert run(["ray", "get-auth-token", "--generate"], 60, log).returncode == 0, tail(log)
        up = run(["ray", "up", "--no-config-cache", "-y", str(cluster_file)], UP_TIMEOUT_S, log)
        assert up.returncode == 0, f"ray up failed:\n{tail(log)}"

        address = wait_for_server(log)
        with DisaggClient(address) as client:
            request = generate_request(
                chat=[{"role": "user", "content": "What is the capital of France?"}], temperature=0.0, max_tokens=12
            )
            tokens, text, final = client.generate(request, timeout=120)
            status = client.cluster_status()
        assert "Paris" in text
        hosts = {pool.role: {i.kv_address.rsplit(":", 1)[0] for i in pool.instances} for pool in status.pools}
        assert hosts == {"prefill": {PREFILL}, "decode": {DECODE}}  # each pool on its own machine
        assert final.timings.prefill_instance != final.timings.decode_instance
        assert_gcs_and_registry_in_head_redis()
        assert_gcs_restart_leaves_the_deployment_serving(address, status)

        down = run(["ray", "down", "-y", str(cluster_file)], DOWN_TIMEOUT_S, log)
        assert down.returncode == 0, f"ray down failed:\n{tail(log)}"
        assert wait_until_gone(DOWN_TIMEOUT_S) == [], (
            f"still running after ray down:\n{tail(HOME / 'disagg-serve.log')}"
        )
        serve_log = (HOME / "disagg-serve.log").read_text(errors="replace")
        assert "disagg: the Ray cluster it joined is gone" in serve_log and "disagg: stopped" in serve_log, serve_log[
            -4000:
        ]
    except BaseException:
        print(f"--- launcher log ---\n{tail(log)}\n--- disagg serve log ---\n{tail(HOME / 'disagg-serve.log')}")
        print(f"--- sshd log ---\n{ssh_server.log()}")
        raise
    finally:
        if up is not None and down is None:  # a failure halfway: the launcher still takes it down
            run(["ray", "down", "-y", str(cluster_file)], DOWN_TIMEOUT_S, log)
        stop_leftovers()
        home.restore()
    assert our_processes() == []
    assert not (HOME / NAME).exists()


def head_redis():
    import redis

    return redis.Redis.from_url((REDIS_DIR / "url").read_text().strip(), socket_timeout=5.0)


def assert_gcs_and_registry_in_head_redis() -> None:
    """Ray's GCS keeps its tables in the head's redis-server (its keys: RAY<namespace>@<table>),
    and `disagg serve --cluster` its registry (disagg:instance:<id>)."""
    client = head_redis()
    try:
        keys = [key.decode(errors="replace") for key in client.scan_iter(count=1000)]
        config = client.config_get("appendonly")
    finally:
        client.close()
    assert any(key.startswith("RAY") and "@" in key for key in keys), f"no GCS table in the head's Redis: {keys[:20]}"
    assert any(":instance:" in key for key in keys), f"no disagg registry key in the head's Redis: {keys[:20]}"
    assert config == {"appendonly": "yes"}


def assert_gcs_restart_leaves_the_deployment_serving(address: str, before) -> None:
    """SIGKILL the head's gcs_server and start it again as it was (what a supervisor would do):
    it reloads its tables from Redis, the workers' actors live on (the same instances, the same
    processes), and the deployment answers without `disagg serve` stopping."""
    from disagg.client import DisaggClient, generate_request

    actor_pids = actor_processes()
    restart_gcs_server()
    with DisaggClient(address) as client:
        request = generate_request(prompt="The capital of France is", temperature=0.0, max_tokens=4)
        deadline = time.monotonic() + 60
        while True:  # the GCS reloading its tables; the serving path needs it not
            try:
                client.generate(request, timeout=30)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        after = client.cluster_status()
    ids = lambda status: sorted(i.instance_id for pool in status.pools for i in pool.instances)  # noqa: E731
    assert ids(after) == ids(before)
    assert actor_pids and set(actor_pids) <= set(actor_processes()), "an actor's process died with the GCS"
    serve_log = tail(HOME / "disagg-serve.log")
    assert "disagg: shutting down" not in serve_log, serve_log


def restart_gcs_server() -> None:
    found = gcs_servers()
    assert len(found) == 1, f"not one gcs_server: {our_processes()}"
    pid = found[0]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    env = dict(line.split(b"=", 1) for line in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in line)
    cwd = os.readlink(f"/proc/{pid}/cwd")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while gcs_servers() and time.monotonic() < deadline:
        time.sleep(0.2)
    # In a session of its own, no child of this process: as `ray start` leaves it (`ray down` ends it).
    subprocess.run(
        ["bash", "-c", 'setsid "$@" </dev/null >/dev/null 2>&1 &', "gcs", *argv], env=env, cwd=cwd, check=True
    )
    deadline = time.monotonic() + 60
    while not gcs_servers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gcs_servers(), "the GCS did not start again"


def gcs_servers() -> list[int]:
    """The head's gcs_server (deploy/cluster.yaml gives it port 6379); `ps -ww`: whole lines."""
    found = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
    return [int(line.split()[0]) for line in found if "/gcs_server " in line and "--gcs_server_port=6379" in line]


def actor_processes() -> list[int]:
    """The processes of the deployment's actors (its workers, controller): `ray::ClassName...`,
    children of a raylet of its own; not the idle workers Ray keeps and ends as it likes."""
    return [
        int(line.split()[0])
        for line in our_processes()
        if "ray::" in line and "ray::IDLE" not in line and NAME.encode() in parent_cmdline(int(line.split()[0]))
    ]


def parent_cmdline(pid: int) -> bytes:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return Path(f"/proc/{stat[stat.rindex(')') + 2 :].split()[1]}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return b""


def wait_for_server(log: Path) -> str:
    """The gRPC address `disagg serve --cluster` writes once it serves: after the autoscaler has
    started the workers' machines and the pools are up on them."""
    ready, serve_log = HOME / "disagg-serve.ready", HOME / "disagg-serve.log"
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().strip():
            return ready.read_text().strip()
        if "disagg: stopped" in tail(serve_log):
            pytest.fail(f"disagg serve ended on the head:\n{tail(serve_log)}")
        time.sleep(2)
    pytest.fail(f"not serving after {SERVE_TIMEOUT_S} s:\n{tail(serve_log)}\n--- launcher ---\n{tail(log)}")


def wait_until_gone(timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := our_processes()) and time.monotonic() < deadline:
        time.sleep(1)
    return left
