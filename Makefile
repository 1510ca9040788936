# The two commands: `make run` (a simulated DGX H100 agent) and `make test` (everything CI runs).
# `make check` is the fast tier: lint, types and every test that starts no process.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

# pytest workers. The process tier mostly waits on agents, Go programs and kube-apiserver, so
# it runs three workers a core (on 2 cores: 4 workers 11.6 min, 6 workers 10.8, before the run
# order and the API-server groups of conftest.py; 9.0 min with them, docs/benchmarks.md); the
# in-process tier is CPU-bound: one per core.
CORES   := $(shell nproc 2>/dev/null || echo 2)
WORKERS ?= $(shell echo $$(( $(CORES) * 3 )))

.PHONY: run test check lint bench clean protos

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is needed; set PYTHON=python3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/gpu-agent serve --simulate dgx-h100

lint: $(STAMP)
	$(BIN)/ruff check agent cdi tests bench
	$(BIN)/mypy

# Every test that starts no process (tests/processes.py decides, at collection).
check: lint
	$(BIN)/pytest -q -m "not process" -n $(CORES)

# Everything, in parallel; the tests of one shared kube-apiserver on one worker (conftest.py).
test: lint
	$(BIN)/pytest -q -n $(WORKERS) --dist loadgroup

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .gpu-agent-sim .gpu-agent-sim.run .pytest_cache .mypy_cache .ruff_cache

# The gRPC stubs (kubelet plugin, PodResources client), committed; regenerate after editing
# agent/kubeplugin/proto/*.proto or agent/podresources/proto/*.proto.
protos: $(STAMP)
	$(BIN)/python -m agent.kubeplugin.protogen
