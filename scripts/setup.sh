#!/usr/bin/env bash
# Installs what atomc needs to build (Debian packages) and, with --test, what its tests
# need (PyPI packages for reference checks). Idempotent; run as root on Debian 12.
set -euo pipefail
want_test=0
for a in "$@"; do [ "$a" = "--test" ] && want_test=1; done

DEBS="build-essential pkg-config libevent-dev libjansson-dev libpcre2-dev libutf8proc-dev libxxhash-dev libopenblas-dev curl unzip"
missing=()
for p in $DEBS; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ $want_test -eq 1 ]; then
    # Headless Chromium for the chat page's browser test (tests/py/test_webui.py).
    TEST_DEBS="chromium chromium-driver"
    missing=()
    for p in $TEST_DEBS; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "setup: installing ${missing[*]}"
        SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    # Reference implementations used only by tests (never needed to build or run atomc).
    python3 -m pip install -q --disable-pip-version-check -r "$(dirname "$0")/../tests/requirements.txt"
fi
