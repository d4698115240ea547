#!/usr/bin/env bash
# README command 1: install build dependencies, build atomc, fetch the default model
# (SmolLM2-135M-Instruct) if absent, and run the main job on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
make -j"$(nproc)" build/atomc >/dev/null
MODEL=${ATOMC_MODEL:-$(bash scripts/fetch_model.sh)}
exec build/atomc generate --model "$MODEL" --chat --prompt "${ATOMC_PROMPT:-What is the capital of France?}" --max-tokens 64 "$@"
