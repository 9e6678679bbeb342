#!/usr/bin/env bash
# LiteLLM's proxy as a benchmark peer: installed on demand into its own venv,
# never a jetserve dependency. Recipe: shared/peers/RECIPES.md.
#
#   bench/peers/litellm.sh install        # create the venv, pip install the proxy
#   bench/peers/litellm.sh path           # print the `litellm` executable (exit 1 if absent)
#   bench/peers/litellm.sh serve CFG PORT # run the proxy in the foreground
#
# The venv lives in $JETSERVE_PEERS/litellm (default ~/.cache/jetserve-peers/litellm),
# outside the work tree so it is never committed or carried.
set -euo pipefail

PEERS="${JETSERVE_PEERS:-$HOME/.cache/jetserve-peers}"
VENV="$PEERS/litellm"
PY="${PYTHON:-python3}"

cmd="${1:-install}"
case "$cmd" in
  install)
    if [ -x "$VENV/bin/litellm" ]; then
      echo "litellm already installed: $VENV/bin/litellm"
      exit 0
    fi
    mkdir -p "$PEERS"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # prisma<1: the proxy imports it at start-up even without a database.
    "$VENV/bin/pip" install -q 'litellm[proxy]' 'prisma<1'
    LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/litellm" --version || true
    echo "installed: $VENV/bin/litellm"
    ;;
  path)
    if [ -x "$VENV/bin/litellm" ]; then
      echo "$VENV/bin/litellm"
    else
      exit 1
    fi
    ;;
  serve)
    cfg="${2:?config file}"
    port="${3:?port}"
    # The local cost map: no fetch of model prices from the internet at start-up.
    LITELLM_LOCAL_MODEL_COST_MAP=True exec "$VENV/bin/litellm" \
      --config "$cfg" --port "$port" --host 127.0.0.1 --num_workers 1
    ;;
  *)
    echo "usage: $0 install|path|serve CFG PORT" >&2
    exit 2
    ;;
esac
