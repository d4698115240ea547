#!/usr/bin/env bash
# Installs what atomc needs to build (Debian packages) and, with --test, what its tests
# need (PyPI packages for reference checks). Idempotent; run as root on Debian 12.
set -euo pipefail
want_test=0
for a in "$@"; do [ "$a" = "--test" ] && want_test=1; done

# Installs the Debian packages given that are not installed yet.
install_debs() {
    local missing=()
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "setup: installing ${missing[*]}"
        local SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# node-llhttp: the C sources of llhttp, the HTTP/1.1 parser the server is built with (Makefile).
# cmake + ninja build xgrammar (scripts/build_xgrammar.sh) for structured output.
install_debs build-essential pkg-config libevent-dev libjansson-dev libpcre2-dev libutf8proc-dev libxxhash-dev \
    libopenblas-dev curl unzip cmake ninja-build node-llhttp

# The grammar engine for structured output (xgrammar's C++ core, a static library in third_party/).
bash "$(dirname "$0")/build_xgrammar.sh"

if [ $want_test -eq 1 ]; then
    # Headless Chromium for the chat page's browser test (tests/py/test_webui.py).
    install_debs chromium chromium-driver
    # Reference implementations used only by tests (never needed to build or run atomc).
    python3 -m pip install -q --disable-pip-version-check -r "$(dirname "$0")/../tests/requirements.txt"
fi
