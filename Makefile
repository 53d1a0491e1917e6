# Build, test and demo entry points. Every target that needs Python installs
# what it needs into $(VENV) first, so `make demo` and `make test` work on a
# fresh clone with nothing but python3 (>= 3.11) on the machine.

VENV ?= .venv
PYTHON ?= python3
# Extra arguments for pip (e.g. PIP_ARGS="--index-url URL" for a CPU-only torch wheel index).
PIP_ARGS ?=
# GPU machines: TORCH_CUDA=cu128 installs torch 2.13.0 built for that CUDA from
# PyTorch's wheel index (and allows the CUDA build the CPU check refuses).
TORCH_CUDA ?=
TORCH_INDEX := $(if $(TORCH_CUDA),--extra-index-url https://download.pytorch.org/whl/$(TORCH_CUDA),)
# Extra arguments for pytest (e.g. PYTEST_ARGS="-k all_reduce -x").
PYTEST_ARGS ?=

VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/collectives/v1/*.proto)
STUB_DIR := client/collectives/v1
# Directories git may not carry when they hold no file yet.
TEST_DIRS := $(wildcard tests/unit tests/integration tests/browser tests/fault)

.DEFAULT_GOAL := help
.PHONY: help install demo test fault bench bench-quick lint format proto proto-check clean distclean

help:
	@echo "make demo         start a local cluster of 2 workers, run examples/demo.py, stop it"
	@echo "make test         lint + proto-check + unit, integration, browser and fault tests"
	@echo "make fault        the fault-injection suite and the soak alone (COLLECTIVES_SOAK_S=40)"
	@echo "make bench        the benchmark table: every figure beside its anchor (full sizes, minutes)"
	@echo "make bench-quick  the same at small sizes (< 2 min; CI runs it); tables in artifacts/"
	@echo "make install      create $(VENV) with the pinned dependencies (done by every target)"
	@echo "make lint         ruff check + ruff format --check"
	@echo "make format       ruff format + ruff check --fix (rewrites files)"
	@echo "make proto        regenerate the gRPC stubs in $(STUB_DIR)"
	@echo "make proto-check  fail if the committed stubs differ from regenerated ones"
	@echo "make clean        remove caches; make distclean also removes $(VENV)"

# torch is pinned in constraints.txt to the CPU build; the check after pip makes
# a CUDA wheel (gigabytes of nvidia-* packages) a loud failure, not a slow surprise.
$(STAMP): constraints.txt client/pyproject.toml server/pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		"collectives needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_ARGS) $(TORCH_INDEX) -c constraints.txt torch==2.13.0 \
		-e client -e server pytest pytest-timeout ruff grpcio-tools numpy \
		selenium pyyaml kubernetes-validate cryptography hypothesis
	@[ -n "$(TORCH_CUDA)" ] || $(VPY) -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else \
		"pip installed a CUDA build of torch " + torch.__version__ + "; install the CPU wheel " \
		"(point PIP_ARGS=\"--index-url URL\" at a CPU-only wheel index)")'
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/demo.py

# Test paths given in PYTEST_ARGS (files, directories, node ids) replace the
# default directories: `make test PYTEST_ARGS=tests/unit/test_sdk.py` runs just that.
ARG_PATHS := $(wildcard $(foreach a,$(PYTEST_ARGS),$(firstword $(subst ::, ,$(a)))))
TEST_PATHS := $(if $(ARG_PATHS),,$(TEST_DIRS))

test: lint proto-check
	$(VPY) -m pytest $(TEST_PATHS) $(PYTEST_ARGS)

# Real signals to real processes; prints time to detect/recover per fault and
# the soak's table. COLLECTIVES_SOAK_S sets the soak's length (seconds).
fault: $(STAMP)
	$(VPY) -m pytest tests/fault -s -p no:logging $(PYTEST_ARGS)

# One markdown table (service | anchor | ratio | target), also written to
# artifacts/bench.md and artifacts/bench.json. BENCH_ARGS="--only putget,latency".
BENCH_ARGS ?=

bench: $(STAMP)
	$(VPY) -m bench $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(VPY) -m bench --quick $(BENCH_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

proto: $(STAMP)
	$(VPY) -m grpc_tools.protoc -I protos --python_out=client --grpc_python_out=client \
		--pyi_out=client $(PROTOS)

# Regenerates into a temporary directory and compares file by file, both ways,
# so a stale stub and a stub without a proto both fail.
proto-check: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(VPY) -m grpc_tools.protoc -I protos --python_out="$$tmp" --grpc_python_out="$$tmp" \
		--pyi_out="$$tmp" $(PROTOS) && \
	if diff -r -x __init__.py -x __pycache__ "$$tmp/collectives/v1" $(STUB_DIR); then \
		echo "proto-check: stubs in $(STUB_DIR) are up to date"; \
	else \
		echo "proto-check: stubs in $(STUB_DIR) differ from protos/; run 'make proto' and commit" >&2; \
		exit 1; \
	fi

clean:
	rm -rf .pytest_cache .ruff_cache build dist
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
