#!/usr/bin/env bash
# Fetches xgrammar's PyPI sdist (pinned version and sha256) and builds its C++ core alone (no
# Python bindings, no tvm-ffi) as a static library: third_party/xgrammar-$VER/build/libxgrammar.a
# with headers under third_party/xgrammar-$VER/src/include. third_party/ is ignored by git and
# survives `make clean`. Idempotent: does nothing when the library is already there.
# Called by scripts/setup.sh and by the Makefile when the library is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VER=0.2.8
SHA=8305646fd2b319d6c3003f51a1665e54cbbe9cba1fb636bc41d0b46434ccbb80
URL=https://files.pythonhosted.org/packages/03/0f/29f521535729be740779c2c98b630ef6607cf28be9b669895dd2b821ff63/xgrammar-$VER.tar.gz
D=third_party/xgrammar-$VER
[ -f "$D/build/libxgrammar.a" ] && exit 0
mkdir -p third_party
if [ ! -f "$D/src/CMakeLists.txt" ]; then
    tgz=third_party/xgrammar-$VER.tar.gz
    if ! echo "$SHA  $tgz" | sha256sum -c --status 2>/dev/null; then
        echo "build_xgrammar: fetching the xgrammar $VER sdist"
        curl -fsSL --retry 3 -o "$tgz.part" "$URL"
        mv "$tgz.part" "$tgz"
        echo "$SHA  $tgz" | sha256sum -c --status || { echo "build_xgrammar: sha256 mismatch for $tgz" >&2; exit 1; }
    fi
    rm -rf "$D/src" && mkdir -p "$D"
    tar -xzf "$tgz" -C "$D"
    mv "$D/xgrammar-$VER" "$D/src"
    # Fix: xgrammar 0.2.8 lets a length-bounded JSON string (minLength / maxLength) hold raw
    # control characters 0x00-0x1f, which JSON forbids (a vocabulary with a "\x0e" token, as
    # Llama-2's has, then yields invalid JSON). Exclude them as its unbounded strings do.
    f="$D/src/cpp/json_schema_converter.cc"
    old="builder_.AddCharacterClass({{'\"', '\"'}, {'\\\\', '\\\\'}, {'\\r', '\\r'}, {'\\n', '\\n'}}, true);"
    new="builder_.AddCharacterClass({{0, 0x1f}, {'\"', '\"'}, {'\\\\', '\\\\'}}, true);"
    python3 - "$f" "$old" "$new" <<'PY'
import sys
p, old, new = sys.argv[1:]
s = open(p).read()
if s.count(old) != 1:
    sys.exit("build_xgrammar: the json_schema_converter.cc patch does not apply")
open(p, "w").write(s.replace(old, new))
PY
fi
mkdir -p "$D/build"
# The sdist's cmake/config.cmake turns the Python bindings on; a config.cmake in the build
# directory takes precedence.
cat > "$D/build/config.cmake" <<'CFG'
set(CMAKE_BUILD_TYPE Release)
set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)
set(XGRAMMAR_BUILD_CXX_TESTS OFF)
set(XGRAMMAR_ENABLE_CPPTRACE OFF)
set(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)
set(XGRAMMAR_ENABLE_COVERAGE OFF)
CFG
gen=(); command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
echo "build_xgrammar: building libxgrammar.a (C++ core only)"
t0=$(date +%s)
cmake -S "$D/src" -B "$D/build" "${gen[@]}" -DCMAKE_CXX_FLAGS="-fno-lto" >"$D/build/cmake.log" 2>&1 ||
    { tail -30 "$D/build/cmake.log" >&2; exit 1; }
cmake --build "$D/build" -j "$(nproc)" >"$D/build/build.log" 2>&1 || { tail -30 "$D/build/build.log" >&2; exit 1; }
echo "build_xgrammar: done in $(( $(date +%s) - t0 )) s"
