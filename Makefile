# The two commands: `make run` (a simulated DGX H100 agent) and `make test` (everything CI runs).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: run test lint bench clean protos

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

test: lint
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .gpu-agent-sim .pytest_cache .mypy_cache .ruff_cache

# The gRPC stubs (kubelet plugin, PodResources client), committed; regenerate after editing
# agent/kubeplugin/proto/*.proto or agent/podresources/proto/*.proto.
protos: $(STAMP)
	$(BIN)/python -m agent.kubeplugin.protogen
