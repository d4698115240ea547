#!/usr/bin/env bash
# Runs every C test binary in $ATOMC_BUILD/tests and the Python reference tests under
# tests/py, then prints one closing line "N passed, N failed, N skipped" summed over all of them.
# A skip means something from outside the repository is missing (SmolLM2, ../shared tokenizers,
# a reference package); with ATOMC_REQUIRE_FIXTURES=1 (CI) every skip is a failure instead
# (tests/harness.c, tests/py/conftest.py). A binary whose last line is not its summary, or that
# exits non-zero with no failure counted, counts as one failure; so does pytest.
set -u
cd "$(dirname "$0")/.."
BUILD=${ATOMC_BUILD:-build}
passed=0; failed=0; skipped=0; broken=()
for t in "$BUILD"/tests/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    out=$("$t" 2>"$BUILD/tests/$name.log"); rc=$?
    last=$(printf '%s\n' "$out" | tail -n 1)
    if [[ $last =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed(,\ ([0-9]+)\ skipped)?$ ]]; then
        p=${BASH_REMATCH[1]}; f=${BASH_REMATCH[2]}; s=${BASH_REMATCH[4]:-0}
    else
        p=0; f=1; s=0
    fi
    if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    printf '%-40s %s\n' "$name" "$last"
    if [ "$f" -ne 0 ]; then broken+=("$name"); grep -E 'FAIL|ERROR|check failed|Sanitizer' "$BUILD/tests/$name.log" | head -20; fi
    if [ "$s" -ne 0 ]; then grep -E '^skip ' "$BUILD/tests/$name.log" | head -20; fi
done
if [ -z "${ATOMC_SKIP_PY:-}" ] && ls tests/py/test_*.py >/dev/null 2>&1; then
    # -rs lists each skip with its reason; a module that fails to import (or, under
    # ATOMC_REQUIRE_FIXTURES=1, skips at import) is an error that does not stop the other modules.
    ATOMC_BIN="$BUILD/atomc" python3 -m pytest -q -rs -p no:cacheprovider --continue-on-collection-errors tests/py \
        2>&1 | tee "$BUILD/pytest.log" | tail -n 30
    rc=${PIPESTATUS[0]}
    # pytest's closing summary, e.g. "3 failed, 120 passed, 4 skipped, 1 error in 30.2s".
    line=$(grep -E '^=*\s*[0-9]+ [a-z]+.* in [0-9.]+s' "$BUILD/pytest.log" | tail -n 1)
    count() { grep -oE "[0-9]+ ($1)\b" <<<"$line" | awk '{s+=$1} END{print s+0}'; }
    p=$(count passed); f=$(count 'failed|errors?'); s=$(count skipped)
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    [ "$f" -ne 0 ] && broken+=("pytest")
fi
[ ${#broken[@]} -gt 0 ] && echo "failing: ${broken[*]}"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
