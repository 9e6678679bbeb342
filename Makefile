# The two commands of the README. Everything else is in pyproject.toml.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: up test setup test-setup lint test-vllm test-llamacpp test-engines conformance-report

# Debian packages, checked every time (cheap) and installed only when missing.
# The fleet needs redis-server; the tests also need chromium (the /playground
# browser test) and promtool (it checks /metrics), which is taken out of Debian's
# prometheus package into .venv/bin: the Prometheus server is not installed.
# apt and dpkg print progress even with -qq ("Setting up ...", triggers): their
# output goes to a file that is shown only when a step fails.
quietly = log=$$(mktemp) && { { $(1); } >$$log 2>&1 || { cat $$log >&2; rm -f $$log; exit 1; }; } && rm -f $$log

define apt_ensure
	@missing=""; for pair in $(1); do cmd=$${pair%%=*}; pkg=$${pair#*=}; \
	  command -v $$cmd >/dev/null || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing (apt-get, as root)"; \
	  $(call quietly,apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends $$missing); fi
endef

$(BIN)/jetserve: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(BIN)/jetserve

setup: $(BIN)/jetserve
	$(call apt_ensure,redis-server=redis-server)

test-setup: setup
	$(call apt_ensure,chromium=chromium)
	@command -v promtool >/dev/null || test -x $(BIN)/promtool || { \
	  echo "installing: promtool (extracted from Debian's prometheus package; no server)"; \
	  tmp=$$(mktemp -d) && chmod 755 $$tmp && cd $$tmp && \
	  $(call quietly,apt-get download -qq prometheus || \
	    { apt-get update -qq && apt-get download -qq prometheus; }) && \
	  dpkg-deb -x prometheus_*.deb root && cp root/usr/bin/promtool $(CURDIR)/$(BIN)/promtool && \
	  cd / && rm -rf $$tmp; }

# Run the embedded default fleet on loopback and show it answering (Ctrl-C stops it).
up: setup
	$(BIN)/jetserve up $(ARGS)

# Lint, type-check and run the whole suite against real nats-server and redis-server:
# all but the fault suite in one process per core (at most 4; a module's tests stay in
# one process), then the fault suite after it, at most two scenarios at a time (its
# scenarios mostly wait on failovers; they share the CPU with no other test); each
# part lists its 15 slowest tests.
test: test-setup lint
	$(BIN)/pytest -q -n auto --maxprocesses 4 --dist loadscope -m "not faults" --durations=15
	$(BIN)/pytest -q -n auto --maxprocesses 2 --dist load -m faults --durations=15

# The adapters' translation-loss reports (docs/conformance.md), against the simulator.
conformance-report: setup
	$(BIN)/python -m jetserve.conformance.publish docs/conformance.md

# The opt-in real-vLLM tier (docs/vllm.md); builds the vLLM CPU peer first if missing.
test-vllm: setup
	bench/peers/vllm.sh test $(ARGS)

# The opt-in real llama.cpp tier (llama-cpp-python[server] built from source for the
# CPU, a tiny GGUF made locally; docs/adapters.md); builds the peer first if missing.
test-llamacpp: setup
	bench/peers/llamacpp.sh test $(ARGS)

# Both real engines, one after the other: each peer is installed if missing, then its
# tier runs (the conformance corpus, a fleet request, cancellation; docs/adapters.md).
# Both run even when the first fails; the target fails if either did.
test-engines: setup
	@rc=0; bench/peers/vllm.sh test $(ARGS) || rc=1; \
	bench/peers/llamacpp.sh test $(ARGS) || rc=1; exit $$rc

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
