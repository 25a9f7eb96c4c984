#!/usr/bin/env bash
# curl against `vllm-specplug serve --config configs/qwen-coder-adaptive.yaml`.
#   bash examples/curl.sh [http://127.0.0.1:8000]
set -euo pipefail
URL=${1:-http://127.0.0.1:8000}
if ! curl -sf "$URL/health" >/dev/null; then
  echo "no server at $URL; start one with:" >&2
  echo "  vllm-specplug models fetch qwen-coder-pair" >&2
  echo "  vllm-specplug serve --config configs/qwen-coder-adaptive.yaml" >&2
  exit 1
fi

# A completion; per-request acceptance is in .metrics.speculative_decoding.
curl -s "$URL/v1/completions" -H 'Content-Type: application/json' -d '{
  "model": "qwen-coder", "prompt": "def add(a, b):\n", "max_tokens": 32, "temperature": 0
}'
echo

# The same with speculation off for this request only.
curl -s "$URL/v1/completions" -H 'Content-Type: application/json' -d '{
  "model": "qwen-coder", "prompt": "def add(a, b):\n", "max_tokens": 32, "temperature": 0,
  "vllm_xargs": {"specplug_max_k": 0}
}'
echo

# Exactly two drafts every step for this request, instead of the adaptive choice.
curl -s "$URL/v1/completions" -H 'Content-Type: application/json' -d '{
  "model": "qwen-coder", "prompt": "def add(a, b):\n", "max_tokens": 32, "temperature": 0,
  "vllm_xargs": {"specplug_k": 2}
}'
echo

# The plugin's Prometheus series.
curl -s "$URL/metrics" | grep '^vllm:specplug_' | head -20
