#!/usr/bin/env bash
# README command 2: install build + test dependencies, build, and run every CPU test.
# Ends with one line "N passed, N failed, N skipped". CI (.ci/run) runs exactly this.
# This script provides everything the tests read from outside the repository (reference
# packages, SmolLM2; the tokenizers come with ../shared), so it runs them with
# ATOMC_REQUIRE_FIXTURES=1: a missing file or package fails the run instead of being skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export ATOMC_SMOLLM2=${ATOMC_SMOLLM2:-$(bash scripts/fetch_model.sh)}
export ATOMC_REQUIRE_FIXTURES=1
make -j"$(nproc)" all
# CI has no GPU: the CUDA build (library, binary, GPU tests and kernel benchmarks) is compiled so it
# cannot rot; the GPU tests themselves run on the GPU machine (`make CUDA=1 gpu-test`).
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    PATH=$PATH:/usr/local/cuda/bin make -j"$(nproc)" CUDA=1 gpu-tests
else
    echo "test.sh: nvcc not found, skipping the CUDA build"
fi
make test
