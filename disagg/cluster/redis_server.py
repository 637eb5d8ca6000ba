"""A throwaway local redis-server, for `disagg serve` without a Redis URL and for tests.

Like `ray start` starting its own GCS: no persistence, its own temp dir, 127.0.0.1 by default,
and it never outlives its owner (stopped at interpreter exit, and sent SIGTERM by the kernel if
the owner is killed outright).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable
from urllib.parse import quote

import redis

from disagg.errors import RegistryUnavailable
from disagg.registry import redact_url

logger = logging.getLogger(__name__)
REDIS_BINARY = "redis-server"
_STOP_TIMEOUT_S = 5.0
_PORT_ATTEMPTS = 3
REDIS_DIR_PREFIX = "disagg-redis-"  # each redis-server's temp dir (its cwd)


def wait_for_redis(url: str, timeout_s: float = 10.0, is_alive: Callable[[], bool] | None = None) -> None:
    """Block until Redis at `url` answers PING; RegistryUnavailable after `timeout_s`.

    A refused password fails at once: waiting would not fix it. So does `is_alive()` returning
    False (the server process we are waiting for has exited).
    """
    deadline = time.monotonic() + timeout_s
    delay_s = 0.01
    client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        while True:
            try:
                client.ping()
                return
            except redis.AuthenticationError as exc:
                raise RegistryUnavailable(f"Redis at {redact_url(url)} refused the password: {exc}") from exc
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if is_alive is not None and not is_alive():
                    raise RegistryUnavailable(f"Redis at {redact_url(url)} exited before answering PING") from exc
                if time.monotonic() + delay_s > deadline:
                    raise RegistryUnavailable(
                        f"Redis at {redact_url(url)} did not answer PING within {timeout_s:.1f}s: {exc}"
                    ) from exc
            time.sleep(delay_s)  # readiness of another process cannot be awaited any other way
            delay_s = min(delay_s * 2, 0.2)
    finally:
        client.close()


def _bind_probe(host: str, port: int) -> int:
    """Bind and release `host:port` (0: any free port); OSError if something listens there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis-server binds
        sock.bind((host, port))
        return sock.getsockname()[1]


def _stop_process(proc: subprocess.Popen, work_dir: str) -> None:
    """Terminate, wait, kill if needed, remove the temp dir. Safe to call on a dead process."""
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=_STOP_TIMEOUT_S)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


class LocalRedis:
    """A redis-server child process on `host:port` (a free port unless given).

    with LocalRedis(password="s3cret") as server:
        registry = Registry(server.url)
    """

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 10.0,
        binary: str = REDIS_BINARY,
        outlive_owner: bool = False,
    ):
        """`outlive_owner`: a deployment's redis-server (`disagg serve`), which must outlive the
        process that started it (SIGKILL or a crash included): no parent-death signal, not
        stopped at interpreter exit; stop() or `disagg stop` (by its pid) ends it."""
        self.host = host
        self.outlive_owner = outlive_owner
        self.password = password
        self.startup_timeout_s = startup_timeout_s
        self.binary = binary
        self._requested_port = port
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._work_dir: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._stopping = threading.Event()
        self.restarts = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> LocalRedis:
        if self.proc is not None:
            raise RuntimeError("LocalRedis already started")
        binary_path = shutil.which(self.binary)
        if binary_path is None:
            raise FileNotFoundError(f"{self.binary} not found; `make setup` installs it")
        attempts = 1 if self._requested_port else _PORT_ATTEMPTS
        for attempt in range(attempts):
            port = self._checked_port()
            try:
                self._start_on(binary_path, port)
                return self
            except RegistryUnavailable:
                # Another process may have taken the free port between our probe and redis' bind.
                self.stop()
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def supervise(self, interval_s: float = 0.5) -> LocalRedis:
        """Restart redis-server on the same port, with the same password, whenever it dies. What
        it holds is soft state: the workers' next heartbeats write it all again."""
        thread = threading.Thread(target=self._supervise, args=(interval_s,), name="redis-supervisor", daemon=True)
        thread.start()
        return self

    def _supervise(self, interval_s: float) -> None:
        while not self._stopping.wait(interval_s):
            proc = self.proc
            if proc is None or proc.poll() is None:
                continue
            logger.warning(
                "redis-server on %s:%s exited (code %s); restarting it", self.host, self.port, proc.returncode
            )
            self._finalizer()  # its temp dir goes
            try:
                self._start_on(shutil.which(self.binary) or self.binary, self.port, from_supervisor=True)
                self.restarts += 1
            except (RegistryUnavailable, OSError) as exc:
                logger.error("could not restart redis-server: %s; trying again", exc)

    def _checked_port(self) -> int:
        # Without this, a PING to a taken port would reach whoever holds it and mislead us.
        try:
            return _bind_probe(self.host, self._requested_port or 0)
        except OSError as exc:
            where = f"{self.host}:{self._requested_port}"
            raise RegistryUnavailable(f"cannot start {self.binary} on {where}: {exc}") from exc

    def _start_on(self, binary_path: str, port: int, from_supervisor: bool = False) -> None:
        work_dir = tempfile.mkdtemp(prefix=REDIS_DIR_PREFIX)
        config_path = Path(work_dir) / "redis.conf"
        # The password goes in a 0600 file, not on the command line where `ps` would show it.
        config_path.write_text(self._config(port, work_dir))
        os.chmod(config_path, 0o600)
        log = open(Path(work_dir) / "redis.log", "wb")
        try:
            self.proc = subprocess.Popen(
                [*self._death_prefix(from_supervisor), binary_path, str(config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=work_dir,
                start_new_session=True,  # the terminal's Ctrl-C goes to the owner, who stops us in order
            )
        finally:
            log.close()
        self.port = port
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, work_dir)
        self._finalizer.atexit = not self.outlive_owner
        self._work_dir = work_dir
        self._wait_until_ready()

    def _config(self, port: int, work_dir: str) -> str:
        lines = [
            f"bind {self.host}",
            f"port {port}",
            f"dir {work_dir}",
            'save ""',
            "appendonly no",
            "daemonize no",
            "loglevel warning",
        ]
        if self.password:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{quoted}"')
        return "\n".join(lines) + "\n"

    def _death_prefix(self, from_supervisor: bool) -> list[str]:
        return [] if self.outlive_owner else self._parent_death_prefix(from_supervisor)

    @staticmethod
    def _parent_death_prefix(from_supervisor: bool = False) -> list[str]:
        # The kernel sends SIGTERM to redis-server when the thread that started it dies, even by
        # SIGKILL, where atexit never runs. Only from the main thread, or the supervisor (which
        # lives until stop()): another thread may exit long before its process does.
        setpriv = shutil.which("setpriv")
        if setpriv is None or not (from_supervisor or threading.current_thread() is threading.main_thread()):
            return []
        return [setpriv, "--pdeathsig", "TERM", "--"]

    def _wait_until_ready(self) -> None:
        try:
            wait_for_redis(self.url, self.startup_timeout_s, is_alive=lambda: self.proc.poll() is None)
        except RegistryUnavailable as exc:
            exit_code = self.proc.poll() if self.proc else None
            raise RegistryUnavailable(
                f"{self.binary} on {self.host}:{self.port} did not start"
                f" (exit code {exit_code}); log: {self._log_tail()!r}; {exc}"
            ) from exc

    def _log_tail(self, max_chars: int = 500) -> str:
        if self._work_dir is None:
            return ""
        try:
            return (Path(self._work_dir) / "redis.log").read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate redis-server (kill after a timeout) and remove its temp dir. Idempotent."""
        self._stopping.set()
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_process at most once, here or at interpreter exit
        self.proc = None

    # -- addresses -------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("LocalRedis not started")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.proc is not None else "stopped"
        where = f"{self.host}:{self.port}" if self.port else "no port"
        return f"LocalRedis({where}, {state})"
