#!/usr/bin/env bash
# A real llama.cpp server (llama-cpp-python[server], built from source for the CPU)
# serving a tiny random-weight GGUF made locally, for the opt-in test tier (marker
# `llamacpp`, docs/adapters.md). Installed on demand into its own venv, never a jetserve
# dependency.
#
#   bench/peers/llamacpp.sh [test] [PYTEST ARGS]  # install if missing, then pytest -m llamacpp
#   bench/peers/llamacpp.sh install               # the venv (a 3-6 min CPU build) and the model
#   bench/peers/llamacpp.sh serve PORT [ARGS]     # llama_cpp.server on 127.0.0.1:PORT
#
# Everything lives in $JETSERVE_LLAMACPP_PEERS (default $JETSERVE_PEERS, else
# ~/.cache/jetserve-peers): llamacpp/ (the venv) and tiny-llama.gguf (the model),
# outside the work tree so it is never committed or carried.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PEERS="${JETSERVE_LLAMACPP_PEERS:-${JETSERVE_PEERS:-$HOME/.cache/jetserve-peers}}"
VENV="$PEERS/llamacpp"
MODEL="$PEERS/tiny-llama.gguf"
PY="${PYTHON:-python3}"

install() {
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then
    mkdir -p "$PEERS"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # From the sdist: a plain CPU build (no BLAS, no GPU backends), every core.
    CMAKE_ARGS="-DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DLLAMA_CURL=OFF" \
      CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "$VENV/bin/pip" install -q --no-binary llama-cpp-python 'llama-cpp-python[server]'
    # The model writer below: the gguf package and numpy only.
    "$VENV/bin/pip" install -q gguf tokenizers
  fi
  if [ ! -f "$MODEL" ]; then
    OUT="$MODEL" "$VENV/bin/python" "$ROOT/bench/peers/make_tiny_gguf.py"
  fi
  echo "llamacpp peer ready: $PEERS"
}

cmd="${1:-test}"
case "$cmd" in
  install)
    install
    ;;
  serve)
    port="${2:?port}"
    shift 2
    exec "$VENV/bin/python" -m llama_cpp.server --model "$MODEL" --model_alias tiny \
      --host 127.0.0.1 --port "$port" --n_ctx 1024 --n_threads 2 --interrupt_requests false "$@"
    ;;
  test)
    shift || true
    install
    cd "$ROOT"
    JETSERVE_LLAMACPP_PEERS="$PEERS" exec "$ROOT/.venv/bin/pytest" -m llamacpp tests/llamacpp -s "$@"
    ;;
  *)
    echo "usage: $0 [test [PYTEST ARGS]] | install | serve PORT" >&2
    exit 2
    ;;
esac
