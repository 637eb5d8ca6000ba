"""Regenerate the committed gRPC/protobuf stubs from proto/, or check that they are current.

    python proto/generate.py          # writes disagg/v1/serving_pb2{,_grpc}.py and .pyi
    python proto/generate.py --check  # exits 1 if the committed stubs differ from fresh ones

The stubs are committed so that an install needs no code generation; `--check` (run by the
unit tests) guards that nobody edits them by hand or forgets to regenerate after a .proto change.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO_FILES = ("disagg/v1/serving.proto",)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into `out_dir`; return the generated files relative to it."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / name) for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    return expected_outputs()


def expected_outputs() -> list[Path]:
    """The stub files each .proto produces, relative to the output root."""
    return [Path(name[: -len(".proto")] + suffix) for name in PROTO_FILES for suffix in GENERATED_SUFFIXES]


def check() -> int:
    """Compare committed stubs with freshly generated ones; print a diff of any mismatch."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        stale = []
        for rel in generate(fresh_root):
            fresh = (fresh_root / rel).read_text()
            committed_path = REPO_ROOT / rel
            committed = committed_path.read_text() if committed_path.exists() else ""
            if fresh != committed:
                stale.append(rel)
                diff = difflib.unified_diff(
                    committed.splitlines(keepends=True),
                    fresh.splitlines(keepends=True),
                    fromfile=f"committed/{rel}",
                    tofile=f"generated/{rel}",
                    n=1,
                )
                sys.stdout.writelines(list(diff)[:40])
    if stale:
        names = ", ".join(str(p) for p in stale)
        print(f"stale or hand-edited stubs: {names}; run `python proto/generate.py`", file=sys.stderr)
        return 1
    print("stubs are current")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are not current")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    for rel in generate(REPO_ROOT):
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
