"""llama.cpp, the CPU peer: built once from source, and its `llama-server` as a process.

The sources are the llama.cpp vendored in the `llama-cpp-python` source distribution (pip can
fetch it where GitHub cannot be reached). The build is cached per version and per CPU
(`~/.cache/disagg/llama.cpp/<version>/<cpu>/`): a native build uses the instructions of the host
it was built on, and this machine's CPU changes from one session to the next. The compile runs
under `nice -n 19`: it takes minutes on 2 cores, and must not slow whatever else runs.

    .venv/bin/python -m loadtest.peers.llamacpp     # build (or find) and print the binaries
    .venv/bin/python -m loadtest.peers.llamacpp --perplexity loadtest/data/perplexity_pydoc.txt

`--perplexity FILE`: llama.cpp's own perplexity of the default GGUF on FILE (`llama-perplexity
-c 512`), the reference an engine's perplexity on the same file is checked against.
loadtest/data/perplexity_pydoc.txt is real English prose: the topics "objects", "execmodel" and
"import" of Python 3.11.7's `pydoc_data.topics` (the Language Reference), joined by blank lines.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from disagg.bench.results import cpu_flags, isa_tag

VERSION = "0.3.36"  # llama-cpp-python's; pinned so that every figure names the llama.cpp it ran
TARGETS = ("llama-server", "llama-perplexity")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "disagg" / "llama.cpp"
BUILD_TIMEOUT_S = 3600  # about 4 minutes at full speed; niced behind a test run, far longer


def cmake_flags(flags: set[str]) -> list[str]:
    """-march=native, except on AMX hosts, where a native llama-server crashes at start
    (docs: DESIGN.md, measured 2026-11-25); there the AVX2/AVX-512 kernels are named instead."""
    common = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"]
    if "amx_tile" not in flags:
        return [*common, "-DGGML_NATIVE=ON"]
    isa = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    if "avx512f" in flags:
        isa += ["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"]
    return [*common, *isa]


def build_dir(version: str = VERSION) -> Path:
    """Per version and per the vector instructions a native build may use."""
    return CACHE / version / isa_tag(cpu_flags())


def built_binaries(version: str = VERSION) -> dict[str, Path]:
    """Each target's path in this CPU's build, built or not."""
    return {t: build_dir(version) / "build" / "bin" / t for t in TARGETS}


def binaries(version: str = VERSION) -> dict[str, Path]:
    """Each target's path, building them first where any is missing."""
    found = built_binaries(version)
    if not all(p.exists() for p in found.values()):
        _build(version, build_dir(version))
    return found


def _build(version: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    source = _unpack_sdist(version, out)
    cmake = _cmake()
    build = out / "build"
    started = time.monotonic()
    print(f"building llama.cpp ({version}, {isa_tag(cpu_flags())}) in {build} ...", file=sys.stderr, flush=True)
    configure = [cmake, "-S", str(source), "-B", str(build), *cmake_flags(cpu_flags())]
    compile_ = [cmake, "--build", str(build), "-j2", "--target", *TARGETS]
    for command in (configure, compile_):
        subprocess.run(["nice", "-n", "19", *command], check=True, timeout=BUILD_TIMEOUT_S)
    print(f"built in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)


def _unpack_sdist(version: str, out: Path) -> Path:
    """The vendored llama.cpp of llama-cpp-python's sdist, unpacked under `out` once."""
    source = out / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if source.exists():
        return source
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "--dest", tmp, f"llama-cpp-python=={version}"],
            check=True, timeout=600,
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(out / "src", filter="data")
    return source


def _cmake() -> str:
    """cmake from PATH, else the `cmake` wheel installed into this interpreter's environment."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found:
        return found
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "cmake"], check=True, timeout=600)
    return str(Path(sys.executable).parent / "cmake")


class LlamaServer:
    """`llama-server` on 127.0.0.1 as a context manager; ready once `/health` answers 200."""

    def __init__(self, binary: Path, gguf: str, port: int, slots: int, slot_context: int, threads: int, log: Path):
        # As a new user starts it: the model, where to listen, slots, a context for them all, threads.
        self.command = [
            str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * slot_context), "-t", str(threads),
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(timeout_s=120)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:  # refused while it binds, 503 while the model loads
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server not healthy after {timeout_s:.0f}s; see {self.log}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def perplexity(binary: Path, gguf: str, text: Path, context: int = 512, threads: int = 2) -> tuple[float, str]:
    """llama-perplexity's final estimate on `text`, and its command line."""
    command = [str(binary), "-m", gguf, "-f", str(text), "-c", str(context), "-t", str(threads)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if not found:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{run.stderr[-2000:]}")
    return float(found.group(1)), " ".join(command)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", default=VERSION, help="of the llama-cpp-python sdist")
    p.add_argument("--perplexity", type=Path, help="a text file: print llama.cpp's perplexity on it")
    args = p.parse_args(argv)
    found = binaries(args.version)
    for name, path in found.items():
        print(name, path)
    if args.perplexity:
        from disagg.engine.loader import default_gguf_path

        ppl, command = perplexity(found["llama-perplexity"], default_gguf_path(), args.perplexity)
        print(f"{command}\nPPL = {ppl:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
