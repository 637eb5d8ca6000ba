"""An SSH server of the test's own on loopback addresses of this machine, for Ray's cluster
launcher: Debian's sshd with a host key, a client key and a config made here, accepting root with
that key only, on port 22 (the launcher has no port setting). Stopped and removed by `stop()`."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without it


def unavailable_reason(addresses: list[str]) -> str | None:
    """Why this machine cannot run the server, or None."""
    if not SSHD.exists():
        return "no SSH server: `make deploy-test` installs Debian's openssh-server, which could not be installed here"
    if shutil.which("rsync") is None:
        return "no rsync (the launcher copies files with it): `make deploy-test` installs it"
    if shutil.which("ssh-keygen") is None:
        return "no ssh-keygen"
    for address in addresses:
        with socket.socket() as probe:
            try:
                probe.bind((address, 22))
            except OSError as exc:
                return f"port 22 on {address} is taken ({exc.strerror}): Ray's launcher can reach no other port"
    return None


class SshServer:
    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self.dir = Path(tempfile.mkdtemp(prefix="disagg-sshd-"))
        self.client_key = self.dir / "id_ed25519"
        self.proc: subprocess.Popen | None = None
        self._made_privsep_dir = False

    def start(self) -> "SshServer":
        host_key = self.dir / "host_ed25519"
        for key in (host_key, self.client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        (self.dir / "authorized_keys").write_text(Path(f"{self.client_key}.pub").read_text())
        config = self.dir / "sshd_config"
        config.write_text(self._config(host_key))
        if not PRIVSEP_DIR.exists():
            PRIVSEP_DIR.mkdir(mode=0o755)
            self._made_privsep_dir = True
        log = open(self.dir / "sshd.log", "wb")
        self.proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_listening()
        return self

    def _config(self, host_key: Path) -> str:
        lines = [f"ListenAddress {address}:22" for address in self.addresses] + [
            f"HostKey {host_key}",
            f"AuthorizedKeysFile {self.dir}/authorized_keys",
            f"PidFile {self.dir}/sshd.pid",
            "PermitRootLogin prohibit-password",
            "AllowUsers root",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the keys live in a temporary directory
            "PrintMotd no",
            "MaxStartups 100",  # the launcher opens several connections at once
            "MaxSessions 100",
        ]
        return "\n".join(lines) + "\n"

    def _wait_listening(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {self.log()}")
            try:
                socket.create_connection((self.addresses[0], 22), timeout=1.0).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"sshd did not listen in {timeout_s} s: {self.log()}")

    def log(self) -> str:
        path = self.dir / "sshd.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._made_privsep_dir:
            shutil.rmtree(PRIVSEP_DIR, ignore_errors=True)
