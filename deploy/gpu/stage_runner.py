"""The machinery of deploy/gpu/run_all.py: stages run in order under one wall-clock budget, each
with its own limit, so that a stage that fails or hangs costs its own time and no other's. Every
command a stage runs gets a process group of its own (killed, with whatever it started, when its
time is up) and a log; after each stage, its logs are appended to $OUT/stages.log and
$OUT/summary.json is rewritten, so a run cut short still says what it did.

A stage is a function of the Context that returns its headline figures (a dict), or raises
Skipped (it does not apply here), Failed (it ran and did not pass) or OutOfTime.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESERVE_S = 10.0  # kept back from the budget for stopping servers and the last summary
SERVER_STOP_S = 30.0  # a server's own shutdown (Ray, redis-server), then SIGKILL for its group


class Skipped(Exception):
    """The stage does not apply here (its message says why)."""


class Failed(Exception):
    """The stage ran and did not pass; `figures`: what it measured all the same."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


class OutOfTime(Exception):
    """The stage's time ran out."""


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[["Context"], dict]
    limit_s: float  # at most this long
    min_s: float = 20.0  # not started with less time left than this
    needs_gpu: bool = False


@dataclass
class Context:
    """What stages share: where to write, the environment of every command, the settings of this
    run (GPU or dry run), the figures of the stages before, and the current stage's deadline."""

    out: Path
    work: Path
    env: dict
    settings: object
    python: str
    results: dict = field(default_factory=dict)
    stage: str = ""
    deadline: float = math.inf

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log_path(self, name: str) -> Path:
        path = self.work / "logs" / self.stage / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def command(self, name: str, argv: list[str], limit_s: float = math.inf, check: bool = True) -> str:
        """The command's output (stdout and stderr); Failed on a non-zero exit when `check`,
        OutOfTime past min(limit_s, the stage's time left)."""
        timeout = min(limit_s, self.left())
        if timeout <= 1:
            raise OutOfTime(f"no time left for {name}")
        log = self.log_path(name)
        header = f"$ {' '.join(argv)}\n"
        with open(log, "w") as sink:
            sink.write(header)
            sink.flush()
            process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=self.env, cwd=REPO,
                                       start_new_session=True)  # fmt: skip
            code = _wait_or_kill(process, timeout)
        output = log.read_text(errors="replace")[len(header) :]
        if code is None:
            raise OutOfTime(f"{name} ran past {timeout:.0f} s")
        if check and code != 0:
            raise Failed(f"{name} exited with {code}: {_last_line(output)}")
        return output

    @contextlib.contextmanager
    def serving(self, name: str, config: Path) -> Iterator[str]:
        """`disagg serve --config config` until the block ends; yields its HOST:PORT."""
        ready = self.work / f"{name}.ready"
        ready.unlink(missing_ok=True)
        argv = [self.python, "-m", "disagg.cli", "serve", "--config", str(config), "--port", str(free_port()),
                "--http-port", "0", "--ready-file", str(ready)]  # fmt: skip
        log = self.log_path(name)
        with open(log, "w") as sink:
            sink.write(f"$ {' '.join(argv)}\n")
            sink.flush()
            process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=self.env, cwd=REPO,
                                       start_new_session=True)  # fmt: skip
        try:
            yield self._wait_ready(process, ready, log)
        finally:
            stop_server(process)

    def _wait_ready(self, process: subprocess.Popen, ready: Path, log: Path) -> str:
        while not (ready.exists() and ready.read_text().strip()):
            if process.poll() is not None:
                raise Failed(f"disagg serve exited with {process.returncode}: {_last_line(log.read_text())}")
            if self.left() <= 0:
                raise OutOfTime("disagg serve was not ready in time")
            time.sleep(0.5)
        return ready.read_text().strip()


def _wait_or_kill(process: subprocess.Popen, timeout: float) -> int | None:
    """The exit code, or None when it ran past `timeout` (then it and its group are killed)."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process, signal.SIGTERM, grace_s=10)
        return None


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM to `disagg serve` (it stops its workers, Ray and redis-server), then SIGKILL to
    whatever of its group is left."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=SERVER_STOP_S)
    kill_group(process, signal.SIGKILL, grace_s=5)


def kill_group(process: subprocess.Popen, sig: int, grace_s: float) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # what the leader left behind in its group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


# ---- the run ------------------------------------------------------------------------------------
def run_stages(stages: list[Stage], ctx: Context, budget_s: float, has_gpu: bool, summary: dict) -> dict:
    """Every stage in order while the budget lasts; the summary, rewritten after each."""
    end = time.monotonic() + budget_s
    summary["stages"] = []
    for stage in stages:
        record = run_stage(stage, ctx, end - time.monotonic() - RESERVE_S, has_gpu)
        summary["stages"].append(record)
        summary["elapsed_s"] = round(budget_s - (end - time.monotonic()), 1)
        append_logs(ctx, stage.name)
        write_json(ctx.out / "summary.json", summary)
        print(
            f"[{stage.name}] {record['status']} ({record['seconds']} s) {json.dumps(record['figures'])[:400]}",
            flush=True,
        )
    return summary


def run_stage(stage: Stage, ctx: Context, left_s: float, has_gpu: bool) -> dict:
    started = time.monotonic()
    ctx.stage, ctx.deadline = stage.name, started + min(stage.limit_s, left_s)
    figures: dict = {}
    if stage.needs_gpu and not has_gpu:
        status = "skipped: no GPU"
    elif left_s < stage.min_s:
        status = f"skipped: out of time ({left_s:.0f} s left, needs {stage.min_s:.0f})"
    else:
        status, figures = _outcome(stage, ctx)
    ctx.results[stage.name] = {"status": status, **figures}
    return {"name": stage.name, "status": status, "seconds": round(time.monotonic() - started, 1), "figures": figures}


def _outcome(stage: Stage, ctx: Context) -> tuple[str, dict]:
    try:
        return "ok", stage.run(ctx)
    except Skipped as exc:
        return f"skipped: {exc}", {}
    except Failed as exc:
        return f"failed: {exc}", exc.figures
    except OutOfTime as exc:
        return f"timeout: {exc}", {}
    except Exception as exc:  # a bug in a stage must not cost the stages after it
        ctx.log_path("traceback").write_text(traceback.format_exc())
        return f"failed: {type(exc).__name__}: {exc}", {}


def append_logs(ctx: Context, stage: str) -> None:
    folder = ctx.work / "logs" / stage
    with open(ctx.out / "stages.log", "a") as sink:
        for log in sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else ():
            sink.write(f"\n===== {stage} / {log.stem} =====\n")
            sink.write(log.read_text(errors="replace")[-200_000:])


def write_json(path: Path, data: dict) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    partial.rename(path)
