#!/usr/bin/env bash
# README command 2: install build + test dependencies, build, and run every CPU test.
# Ends with one line "N passed, N failed". CI (.ci/run) runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export ATOMC_SMOLLM2=${ATOMC_SMOLLM2:-$(bash scripts/fetch_model.sh)}
make -j"$(nproc)" all
make test
