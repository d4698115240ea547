#!/usr/bin/env bash
# Runs every C test binary in $ATOMC_BUILD/tests and the Python reference tests under
# tests/py, then prints one closing line "N passed, N failed" summed over all of them.
set -u
cd "$(dirname "$0")/.."
BUILD=${ATOMC_BUILD:-build}
passed=0; failed=0; broken=()
for t in "$BUILD"/tests/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    out=$("$t" 2>"$BUILD/tests/$name.log"); rc=$?
    last=$(printf '%s\n' "$out" | tail -n 1)
    if [[ $last =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
        p=${BASH_REMATCH[1]}; f=${BASH_REMATCH[2]}
    else
        p=0; f=1
    fi
    if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    passed=$((passed + p)); failed=$((failed + f))
    printf '%-40s %s\n' "$name" "$last"
    if [ "$f" -ne 0 ]; then broken+=("$name"); grep -E 'FAIL|ERROR|check failed|Sanitizer' "$BUILD/tests/$name.log" | head -20; fi
done
if [ -z "${ATOMC_SKIP_PY:-}" ] && ls tests/py/test_*.py >/dev/null 2>&1; then
    ATOMC_BIN="$BUILD/atomc" python3 -m pytest -q -p no:cacheprovider tests/py 2>&1 | tee "$BUILD/pytest.log" | tail -n 30
    line=$(grep -E '[0-9]+ (passed|failed)' "$BUILD/pytest.log" | tail -n 1)
    p=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+'); f=$(grep -oE '[0-9]+ (failed|errors?)' <<<"$line" | awk '{s+=$1} END{print s+0}')
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0}))
    [ -n "${f:-}" ] && [ "${f:-0}" -ne 0 ] && broken+=("pytest")
fi
[ ${#broken[@]} -gt 0 ] && echo "failing: ${broken[*]}"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
