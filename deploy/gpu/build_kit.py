"""`make gpu-kit`: what a bare GPU machine lacks for `disagg serve` and deploy/gpu/run_all.py,
built here in parts that one device call each can carry (a call carries at most 64 MiB, the
working tree included).

The machine has Python 3.12, CUDA torch, Triton, transformers, tokenizers, numpy, aiohttp,
msgpack, protobuf, grpcio 1.84, pyyaml, prometheus-client, matplotlib and pytest, and reaches no
package registry. It lacks, and the kit holds:
  part a  wheels/: Ray (the version of our venv, repacked without its Java jars, dashboard
            front-end, RLlib, Serve, Data, Train, Tune and LLM: 35 MB that nothing here runs),
            the grpcio our generated stubs were made for (disagg/v1/serving_pb2_grpc.py refuses
            an older one), its health and reflection services and the protobuf they need, the
            Redis client, jsonschema and what it needs (Ray imports it), gguf (the default
            model's reader), llguidance (structured output);
          redis-server.tar.xz: redis-server from Debian's package with the shared libraries it
            links, less glibc and the GCC runtime (bin/redis-server sets LD_LIBRARY_PATH for it);
          tokenizer.tar.xz: the default model's tokenizer and config.json, without weights (the
            benchmarks of random-weight models tokenize with it);
  b, c    the default model's GGUF in equal pieces, with model.json to check them.
deploy/gpu/install_kit.py puts the parts together there (docs/deploy.md: "On a GPU").

    .venv/bin/python deploy/gpu/build_kit.py [--out .gpu] [--python-version 3.12] [--no-model]

Needs pip's registry and Debian's (apt-get download, dpkg-deb). The last line printed is
`gpu kit MiB: N`, N the largest part.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
CALL_LIMIT_MIB = 64  # what one device call carries, the working tree included
# Distributions the machine lacks, at our venv's versions (pyproject.toml's dependencies, one by
# one, against the machine's packages; Ray's own requirements likewise).
WHEELS = (
    "ray",
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "redis",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "gguf",
    "llguidance",
)
# pip matches --platform tags exactly: every manylinux level up to what the machine's glibc runs.
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64") + tuple(
    f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35)
)
# Parts of Ray's wheel nothing of ours runs: Java workers, the dashboard's web front-end (its
# server runs without it), and the libraries on top of Ray core (RLlib, Serve, Data, Train, Tune,
# LLM), which Ray core, `ray start` and the dashboard import only when asked for them.
RAY_DROPPED = (
    "ray/jars/",
    "ray/dashboard/client/",
    "ray/rllib/",
    "ray/serve/",
    "ray/data/",
    "ray/train/",
    "ray/tune/",
    "ray/llm/",
)
RAY_REPACK_VERSION = "2"  # bump when RAY_DROPPED changes: repacked wheels are cached under it
# Packages every Debian or Ubuntu with a C++ Python stack has: glibc and the GCC runtime.
BASE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6"}
BASE_SONAMES = re.compile(r"^(libc|libm|libdl|librt|libpthread|libresolv|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so")
TOKENIZER_SKIPPED = re.compile(r"\.safetensors(\.index\.json)?$")


class KitError(RuntimeError):
    """The kit cannot be built as asked (the message says why)."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    check_replaceable(out)
    with tempfile.TemporaryDirectory(prefix="gpu-kit-") as tmp:
        work = Path(tmp)
        staged = stage_part_a(work, args)
        pieces = [] if args.no_model else split_model(default_gguf(), work / "model", args.max_part_mib * MiB)
        parts = write_parts(out, staged, pieces)
    report(parts)
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / ".gpu"), help="the kit's folder (replaced)")
    p.add_argument("--python-version", default="3.12", help="of the machine's python3 (wheels are per version)")
    p.add_argument("--max-part-mib", type=float, default=56.0, help="of each model part (a call carries 64 MiB in all)")
    p.add_argument("--no-model", action="store_true", help="leave out the default model's GGUF (parts b, c)")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "disagg" / "gpu-kit"), help="repacked wheels")
    return p.parse_args(argv)


def check_replaceable(out: Path) -> None:
    """The folder is replaced: refuse one that holds anything but kit parts (a, b, ...)."""
    if out.exists() and any(not (child.is_dir() and re.fullmatch(r"[a-z]", child.name)) for child in out.iterdir()):
        raise KitError(f"{out} holds more than kit parts; give another --out")


# ---- part a ---------------------------------------------------------------------------------------
def stage_part_a(work: Path, args) -> Path:
    """Everything but the model's weights, under work/a."""
    part = work / "a"
    wheels = part / "wheels"
    wheels.mkdir(parents=True)
    download_wheels(wheels, args.python_version)
    repack_ray(wheels, Path(args.cache))
    bundle_redis(work / "redis", part / "redis-server.tar.xz")
    pack_tokenizer(work / "tokenizer", part / "tokenizer.tar.xz")
    write_json(part / "kit.json", {"python_version": args.python_version, "wheels": sorted(os.listdir(wheels))})
    return part


def download_wheels(dest: Path, python_version: str) -> None:
    digits = python_version.replace(".", "")
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    abis = ["--abi", f"cp{digits}", "--abi", "abi3", "--abi", "none"]
    specs = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python_version, "--implementation", "cp", *abis, *platforms, "-d", str(dest)]
    run(command + specs, "pip download")
    found = {_distribution_of(wheel) for wheel in dest.glob("*.whl")}
    missing = {_normalized(name) for name in WHEELS} - found
    if missing:
        raise KitError(f"pip downloaded no wheel for {sorted(missing)}")


def _distribution_of(wheel: Path) -> str:
    return _normalized(wheel.name.split("-")[0])


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def repack_ray(wheels: Path, cache: Path) -> None:
    """Ray's wheel without RAY_DROPPED (and their RECORD lines), cached: rewriting it takes ~10 s."""
    (original,) = wheels.glob("ray-*.whl")
    cached = cache / f"repack-v{RAY_REPACK_VERSION}" / original.name
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".partial")
        _rewrite_without(original, partial, RAY_DROPPED)
        partial.rename(cached)
    shutil.copyfile(cached, original)


def _rewrite_without(source: Path, dest: Path, dropped: tuple[str, ...]) -> None:
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(dropped):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = _record_without(data.decode(), dropped).encode()
            elif info.filename.endswith(".dist-info/entry_points.txt"):
                data = _entry_points_without(data.decode(), dropped).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)


def _record_without(record: str, dropped: tuple[str, ...]) -> str:
    return "".join(line for line in record.splitlines(keepends=True) if not line.startswith(dropped))


def _entry_points_without(text: str, dropped: tuple[str, ...]) -> str:
    """Console scripts into dropped packages (`rllib`) would install commands that cannot start."""
    modules = tuple(prefix.rstrip("/").replace("/", ".") for prefix in dropped)
    keep = lambda line: not re.search(r"=\s*(" + "|".join(map(re.escape, modules)) + r")\b", line)  # noqa: E731
    return "".join(line for line in text.splitlines(keepends=True) if keep(line))


# ---- redis-server ---------------------------------------------------------------------------------
def bundle_redis(work: Path, dest: Path) -> None:
    """redis-server from Debian's redis-tools (its binary is redis-check-rdb, which serves when
    named redis-server) and the libraries it links, checked with ldd, as a tar.xz."""
    debs, root, bundle = work / "debs", work / "root", work / "redis"
    debs.mkdir(parents=True)
    options = apt_options(work / "apt-lists")
    run(["apt-get", *options, "download", *library_closure("redis-tools", options)], "apt-get download", cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        run(["dpkg-deb", "-x", str(deb), str(root)], f"dpkg-deb -x {deb.name}")
    _lay_out_redis(root, bundle)
    check_links(bundle / "libexec" / "redis-server", bundle / "lib")
    run([str(bundle / "bin" / "redis-server"), "--version"], "the bundled redis-server")
    with tarfile.open(dest, "w:xz") as tar:
        tar.add(bundle, arcname="redis")


def apt_options(lists: Path) -> list[str]:
    """No options where this machine's apt knows redis-tools; else package lists fetched into a folder
    of our own, which every apt call then reads."""
    try:
        run(["apt-cache", "show", "redis-tools"], "apt-cache show redis-tools")
        return []
    except KitError:
        (lists / "partial").mkdir(parents=True, exist_ok=True)
        options = [f"-oDir::State::Lists={lists}"]
        run(["apt-get", *options, "update"], "apt-get update")
        return options


def library_closure(package: str, options: list[str]) -> list[str]:
    """`package` and the library packages it needs, transitively, less BASE_PACKAGES."""
    seen, todo = set(), [package]
    while todo:
        name = todo.pop()
        if name in seen or name in BASE_PACKAGES:
            continue
        seen.add(name)
        todo += [dep for dep in direct_depends(name, options) if dep.startswith("lib")]
    return sorted(seen)


def direct_depends(package: str, options: list[str]) -> list[str]:
    output = run(["apt-cache", *options, "depends", package], f"apt-cache depends {package}")
    return re.findall(r"^\s+(?:Pre)?Depends: ([^\s<>]+)$", output, re.MULTILINE)


def _lay_out_redis(root: Path, bundle: Path) -> None:
    for sub in ("bin", "lib", "libexec"):
        (bundle / sub).mkdir(parents=True)
    shutil.copy2(root / "usr" / "bin" / "redis-check-rdb", bundle / "libexec" / "redis-server")
    for folder in (root / "usr" / "lib" / "x86_64-linux-gnu", root / "lib" / "x86_64-linux-gnu"):
        for lib in folder.glob("*.so*") if folder.is_dir() else ():
            shutil.copy2(lib, bundle / "lib" / lib.name, follow_symlinks=False)
    wrapper = bundle / "bin" / "redis-server"
    wrapper.write_text(
        "#!/bin/sh\n# The bundled libraries for redis-server alone (never for the Python processes).\n"
        'here="$(dirname "$(readlink -f "$0")")/.."\n'
        'LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/libexec/redis-server" "$@"\n'
    )
    wrapper.chmod(0o755)


def check_links(binary: Path, libs: Path) -> None:
    """Every library the binary links resolves, and each one outside BASE_PACKAGES from the bundle."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(libs)}
    output = run(["ldd", str(binary)], "ldd redis-server", env=env)
    problems = [line.strip() for line in output.splitlines() if "not found" in line or _foreign(line, libs)]
    if problems:
        raise KitError("redis-server links libraries the bundle lacks: " + "; ".join(problems))


def _foreign(ldd_line: str, libs: Path) -> bool:
    match = re.match(r"\s*(\S+) => (\S+)", ldd_line)
    return bool(match) and not BASE_SONAMES.match(match.group(1)) and not match.group(2).startswith(str(libs))


# ---- the default model ----------------------------------------------------------------------------
def pack_tokenizer(work: Path, dest: Path) -> None:
    """The converted default model's folder (config.json, tokenizer files), less its weights."""
    work.mkdir(parents=True)
    for path in sorted(Path(converted_default_model()).iterdir()):
        if path.is_file() and not TOKENIZER_SKIPPED.search(path.name):
            shutil.copy2(path, work / path.name)
    # The class by the name every transformers release knows (5.x saves its new name,
    # TokenizersBackend, which the machine's older 5.x may not): the same tokenizer.json either way.
    settings = json.loads((work / "tokenizer_config.json").read_text())
    write_json(work / "tokenizer_config.json", {**settings, "tokenizer_class": "PreTrainedTokenizerFast"})
    with tarfile.open(dest, "w:xz") as tar:
        tar.add(work, arcname="tokenizer")


def converted_default_model() -> str:
    sys.path.insert(0, str(REPO))
    from disagg.config import EngineConfig
    from disagg.engine.gguf_convert import cached_hf_dir

    return cached_hf_dir(str(default_gguf()), EngineConfig().cache_dir)


def default_gguf() -> Path:
    sys.path.insert(0, str(REPO))
    from disagg.engine.loader import default_gguf_path

    return Path(default_gguf_path())


def split_model(gguf: Path, work: Path, max_piece: float) -> list[Path]:
    """The GGUF in equal pieces of at most `max_piece` bytes (a part each), and model.json."""
    work.mkdir(parents=True)
    size = gguf.stat().st_size
    count = math.ceil(size / (max_piece - MiB))  # room for model.json
    piece_size = math.ceil(size / count)
    pieces = [work / f"model.gguf.{i:02d}" for i in range(count)]
    digest = hashlib.sha256()
    with open(gguf, "rb") as source:
        for piece in pieces:
            data = source.read(piece_size)
            digest.update(data)
            piece.write_bytes(data)
    write_json(work / "model.json", {"name": gguf.name, "size": size, "sha256": digest.hexdigest(), "pieces": count})
    return pieces


# ---- parts ----------------------------------------------------------------------------------------
def write_parts(out: Path, part_a: Path, pieces: list[Path]) -> list[Path]:
    """.gpu/a from the staged part, then one part per model piece (b, c, ...), each with model.json."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(part_a, out / "a")
    parts = [out / "a"]
    for index, piece in enumerate(pieces):
        part = out / chr(ord("b") + index)
        part.mkdir()
        shutil.copy2(piece, part / piece.name)
        shutil.copy2(piece.parent / "model.json", part / "model.json")
        parts.append(part)
    return parts


def report(parts: list[Path]) -> None:
    tree = tracked_tree_bytes()
    sizes = {part: folder_bytes(part) for part in parts}
    for part, size in sizes.items():
        print(f"part {part.name}: {size / MiB:.1f} MiB ({', '.join(sorted(os.listdir(part)))})")
    largest = max(sizes.values())
    print(f"working tree (tracked files): {tree / MiB:.1f} MiB; largest part with it: {(largest + tree) / MiB:.1f} MiB")
    if largest + tree > CALL_LIMIT_MIB * MiB:
        raise KitError(f"a call carries at most {CALL_LIMIT_MIB} MiB: lower --max-part-mib")
    print(f"gpu kit MiB: {largest / MiB:.1f}")


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def tracked_tree_bytes() -> int:
    try:
        names = run(["git", "ls-files", "-z"], "git ls-files", cwd=REPO).split("\0")
    except KitError:
        return 0  # not a checkout: nothing to add
    return sum((REPO / name).stat().st_size for name in names if name and (REPO / name).is_file())


# ---- helpers --------------------------------------------------------------------------------------
def run(command: list[str], what: str, cwd: Path | None = None, env: dict | None = None) -> str:
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KitError(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise KitError(f"{what} exited with {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KitError as exc:
        print(f"gpu kit: {exc}", file=sys.stderr)
        sys.exit(1)
