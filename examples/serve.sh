#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Serve the bundled SmolLM2-135M-Instruct with ESP on 127.0.0.1:8000 and ask
# it one chat question. Run from the repository root: bash examples/serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
export PATH="$PWD/.venv/bin:$PATH"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
MODEL="$(python -m vllm_esp_dev.models path smollm2-135m)"

vllm serve "$MODEL" --host 127.0.0.1 --port 8000 --max-model-len 2048 \
  --speculative-config '{"method": "esp", "tree": [4]}' &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf http://127.0.0.1:8000/health >/dev/null; do sleep 2; done

curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d "{
  \"model\": \"$MODEL\", \"max_tokens\": 64, \"temperature\": 0,
  \"messages\": [{\"role\": \"user\", \"content\": \"Name three colors.\"}]}"
echo
# ESP's spec-decode counters: drafts = verification steps, draft tokens =
# tree nodes, accepted = accepted nodes.
curl -s http://127.0.0.1:8000/metrics | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total'
