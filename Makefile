# Build, test and demo entry points. Every target that needs Python installs
# what it needs into $(VENV) first, so `make demo` and `make test` work on a
# fresh clone with nothing but python3 (>= 3.11) on the machine.

VENV ?= .venv
PYTHON ?= python3
# Extra arguments for pip (e.g. PIP_ARGS="--index-url URL" for a CPU-only torch wheel index).
PIP_ARGS ?=
# GPU machines: TORCH_CUDA=cu128 installs torch 2.13.0 built for that CUDA from
# PyTorch's wheel index (and allows the CUDA build the CPU check refuses).
# A venv made with TORCH_CUDA remembers it (a later reinstall keeps the CUDA build).
TORCH_CUDA ?= $(shell cat $(VENV)/.torch-cuda 2>/dev/null)
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
.PHONY: help install demo test test-quick test-roads soak fault bench bench-quick gpu-check lint format proto proto-check docs clean distclean

help:
	@echo "make demo         start a local cluster of 2 workers, run examples/demo.py, stop it"
	@echo "make test         lint + proto-check + unit, integration, browser and fault tests"
	@echo "make test-quick   lint + proto-check + unit and the core integration tests (< 3 min)"
	@echo "make test-roads   the behaviour tests again with lanes and the bulk port off (gRPC only)"
	@echo "make fault        the fault-injection suite and the soak alone (COLLECTIVES_SOAK_S=40)"
	@echo "make soak         the many-clients model test, long (SOAK_EXAMPLES=200 examples of 60 steps)"
	@echo "make bench        the benchmark table: every figure beside its anchor (full sizes, minutes)"
	@echo "make bench-quick  the same at small sizes (< 3 min); tables in artifacts/"
	@echo "make gpu-check    the GPU paths end to end on this machine's GPUs (one line and exit 0 without one)"
	@echo "make install      create $(VENV) with the pinned dependencies (done by every target)"
	@echo "make lint         ruff check + ruff format --check"
	@echo "make format       ruff format + ruff check --fix (rewrites files)"
	@echo "make proto        regenerate the gRPC stubs in $(STUB_DIR)"
	@echo "make proto-check  fail if the committed stubs differ from regenerated ones"
	@echo "make docs         regenerate docs/flags.md from the daemons' declared settings"
	@echo "                  and docs/api.md's reference blocks from the SDK's docstrings"
	@echo "make clean        remove caches; make distclean also removes $(VENV)"

# torch is pinned in constraints.txt to the CPU build; the check after pip makes
# a CUDA wheel (gigabytes of nvidia-* packages) a loud failure, not a slow surprise.
# --no-compile: Python compiles a module when it is first imported (and caches it);
# pip compiling all of torch up front took 30 s of a fresh install's 80.
$(STAMP): constraints.txt client/pyproject.toml server/pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		"collectives needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --no-compile $(PIP_ARGS) $(TORCH_INDEX) -c constraints.txt torch==2.13.0 \
		-e client -e server pytest pytest-timeout pytest-xdist ruff grpcio-tools numpy \
		selenium pyyaml kubernetes-validate cryptography hypothesis py-spy
	@[ -n "$(TORCH_CUDA)" ] || $(VPY) -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else \
		"pip installed a CUDA build of torch " + torch.__version__ + "; install the CPU wheel " \
		"(point PIP_ARGS=\"--index-url URL\" at a CPU-only wheel index)")'
	@if [ -n "$(TORCH_CUDA)" ]; then echo "$(TORCH_CUDA)" > $(VENV)/.torch-cuda; fi
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/demo.py

# Test paths given in PYTEST_ARGS (files, directories, node ids) replace the
# default directories: `make test PYTEST_ARGS=tests/unit/test_sdk.py` runs just that.
ARG_PATHS := $(wildcard $(foreach a,$(PYTEST_ARGS),$(firstword $(subst ::, ,$(a)))))
TEST_PATHS := $(if $(ARG_PATHS),,$(TEST_DIRS))

# The suite runs in TEST_PROCESSES pytest-xdist processes, each taking whole test
# files (--dist loadfile: a module's shared cluster starts once) in collection
# order (--no-loadscope-reorder: each process runs its integration files one
# after the other, so the shared clusters stop when it leaves them;
# tests/conftest.py); 1 runs it in this process alone. The default is the
# fastest measured on the 2-core CI machine.
TEST_PROCESSES ?= 3
XDIST := $(if $(filter 1,$(TEST_PROCESSES)),-p no:xdist,-n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder)

test: lint proto-check
	$(VPY) -m pytest $(XDIST) $(TEST_PATHS) $(PYTEST_ARGS)

# The inner loop: the unit tests and the integration tests of the core calls
# (collectives, DataParallel, training, errors, several clients), on the shared
# clusters only. `make test` (what CI runs) is the whole suite.
QUICK_TESTS := tests/unit $(addprefix tests/integration/,test_collectives_reductions.py \
	test_collectives_data_movement.py test_collectives_groups_async.py test_data_parallel.py \
	test_training.py test_many_clients.py test_errors.py test_placement.py)

test-quick: lint proto-check
	$(VPY) -m pytest $(XDIST) $(QUICK_TESTS) $(PYTEST_ARGS)

# The behaviour tests again with the shared clusters' fast roads off (no bulk port,
# no call lanes: gRPC only), so both roads give the same answers (docs/design.md,
# "Two roads for one behaviour"); CI runs it after `make test`.
ROAD_TESTS := $(addprefix tests/integration/,test_collectives_reductions.py \
	test_collectives_data_movement.py test_collectives_groups_async.py test_coalesced.py \
	test_op_path_sizes.py test_p2p.py test_data_parallel.py test_training.py \
	test_train_eval_mode.py test_publish.py test_many_clients.py test_errors.py)

test-roads: $(STAMP)
	COLLECTIVES_TEST_ROADS=grpc $(VPY) -m pytest $(XDIST) $(ROAD_TESTS) $(PYTEST_ARGS)

# Real signals to real processes; prints time to detect/recover per fault and
# the soak's table. COLLECTIVES_SOAK_S sets the soak's length (seconds; make test
# runs the test's default, 20).
COLLECTIVES_SOAK_S ?= 40

fault: $(STAMP)
	COLLECTIVES_SOAK_S=$(COLLECTIVES_SOAK_S) $(VPY) -m pytest tests/fault -s -p no:logging $(PYTEST_ARGS)

# The many-clients model test (tests/integration/test_many_clients_model.py), long:
# SOAK_EXAMPLES examples of up to 60 steps each, from a fresh random seed (printed;
# COLLECTIVES_MODEL_TEST_SEED=N replays one). make test runs 12 examples.
SOAK_EXAMPLES ?= 200

soak: $(STAMP)
	COLLECTIVES_MODEL_TEST_EXAMPLES=$(SOAK_EXAMPLES) COLLECTIVES_MODEL_TEST_STEPS=60 \
		COLLECTIVES_MODEL_TEST_TIMEOUT_S=7200 $(VPY) -m pytest -p no:xdist -s \
		tests/integration/test_many_clients_model.py -k against_the_reference $(PYTEST_ARGS)

# One markdown table (service | anchor | ratio | target), also written to
# artifacts/bench.md and artifacts/bench.json. BENCH_ARGS="--only putget,latency".
BENCH_ARGS ?=

bench: $(STAMP)
	$(VPY) -m bench $(BENCH_ARGS)

# NCCL worlds of 1 and 2 GPUs: put/get, every collective against plain
# torch.distributed, an exported model's forward and train_step, a peer killed
# mid-collective and its rejoin (bench/gpu_check.py). Exits 1 on a wrong result.
gpu-check: $(STAMP)
	$(VPY) -m bench.gpu_check

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
# docs/flags.md: every subcommand's --help, from the settings the daemons declare
# (collectives_server.settings); tests/unit/test_flag_reference.py fails when stale.
# docs/api.md: the blocks between <!-- api: ... --> and <!-- /api --> rendered from
# the SDK's docstrings (tools/api_reference.py, which also fails when a public call
# has no block); tests/unit/test_api_reference.py fails when stale.
docs: $(STAMP)
	$(VPY) -m collectives_server.cli.reference > docs/flags.md
	$(VPY) tools/api_reference.py

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
