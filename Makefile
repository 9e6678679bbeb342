# The two commands of the README. Everything else is in pyproject.toml.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: up test setup lint

$(BIN)/jetserve: pyproject.toml
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(BIN)/jetserve

setup: $(BIN)/jetserve

# Run the embedded default fleet on loopback and show it answering (Ctrl-C stops it).
up: setup
	$(BIN)/jetserve up $(ARGS)

# Lint, type-check and run the whole suite against real nats-server and redis-server.
test: setup lint
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
