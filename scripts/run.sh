#!/usr/bin/env bash
# README command 1: install build dependencies, build atomc, fetch the default model
# (SmolLM2-135M-Instruct) if absent, and serve it with the OpenAI-compatible API.
# Env: ATOMC_MODEL (model path), ATOMC_HOST (127.0.0.1), ATOMC_PORT (8000); extra arguments
# go to `atomc serve` (see `build/atomc serve --help`). Ctrl-C stops the server gracefully.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
make -j"$(nproc)" build/atomc >/dev/null
MODEL=${ATOMC_MODEL:-$(bash scripts/fetch_model.sh)}
HOST=${ATOMC_HOST:-127.0.0.1}
PORT=${ATOMC_PORT:-8000}
NAME=$(basename "$MODEL")
cat <<MSG

Starting atomc on http://$HOST:$PORT (model $NAME). Once it logs "serving", try:

  curl http://$HOST:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$NAME", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64}'

MSG
exec build/atomc serve --model "$MODEL" --host "$HOST" --port "$PORT" "$@"
