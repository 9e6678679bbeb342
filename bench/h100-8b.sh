#!/usr/bin/env bash
# The documented run (docs/bench.md): direct vs jetserve vs LiteLLM, all in front of
# one simulator with the h100-8b profile (max_num_seqs 16), 2 workers, offered loads
# from light through saturation. About 12 minutes on a quiet 2-core machine (each run
# first waits, up to 60 s, for other processes to leave the cores alone, and a run they
# disturbed anyway is repeated, twice at most).
#
#   bench/h100-8b.sh [OUT_DIR]        (default bench/results/h100-8b)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/h100-8b}"

# LiteLLM's proxy lives in its own venv, installed on first use (never a dependency).
bash bench/peers/litellm.sh install

exec .venv/bin/jetserve bench --fleet --profile h100-8b --workers 2 --litellm yes \
  --sweep 2,3,4,5,6,8 --duration 20s \
  --input-len uniform:128:384 --output-len uniform:64:192 \
  --prefix-groups 4 --prefix-len 128 --prefix-share 0.3 \
  --slo ttft=300ms --slo tpot=50ms --slo-target 0.9 \
  --drain 20s --seed 1 --wait-quiet 0.25 --wait-quiet-max 60s --max-other 0.5 --retries 2 \
  --title "direct vs jetserve vs LiteLLM: simulator h100-8b, 2 workers" \
  --out "$OUT"
