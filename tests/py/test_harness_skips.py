"""The skip accounting itself: tests/py/conftest.py turns every kind of skip into a failure under
ATOMC_REQUIRE_FIXTURES=1 (and leaves them alone without it), and tests/run_all.sh sums the C
binaries' "N passed, N failed, N skipped" lines, counting a binary that prints no summary or exits
non-zero with nothing failed as one failure."""
import os
import re
import shutil
import stat
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

SKIPPING_TESTS = '''
import pytest

def test_passes():
    pass

def test_skips_at_run_time():
    pytest.skip("fixture gone")

@pytest.mark.skipif(True, reason="SmolLM2 not set")
def test_skipif_mark():
    pass

@pytest.mark.xfail(reason="expected to fail, not a skip")
def test_xfail():
    assert False
'''

SKIPPING_MODULE = '''
import pytest
pytest.importorskip("atomc_no_such_reference_package")

def test_never_collected():
    pass
'''


def counts(summary):
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)\b", summary)}


def run_pytest(tmp_path, strict):
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_skipping.py").write_text(SKIPPING_TESTS)
    (tmp_path / "test_skipping_module.py").write_text(SKIPPING_MODULE)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # only the conftest under test
    env.pop("ATOMC_REQUIRE_FIXTURES", None)
    if strict is not None:
        env["ATOMC_REQUIRE_FIXTURES"] = strict
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                        str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    return r.returncode, counts(r.stdout.strip().splitlines()[-1]), r.stdout


def test_conftest_counts_skips_without_the_switch(tmp_path):
    for strict in (None, "0", ""):
        rc, c, out = run_pytest(tmp_path, strict)
        assert rc == 0, out
        assert c == {"passed": 1, "skipped": 3, "xfailed": 1}, out


def test_conftest_fails_every_skip_under_the_switch(tmp_path):
    rc, c, out = run_pytest(tmp_path, "1")
    assert rc != 0, out
    # The run-time skip fails; the skipif mark (setup) and the module-level importorskip
    # (collection) are errors; the pass and the xfail are untouched.
    assert c == {"passed": 1, "failed": 1, "errors": 2, "xfailed": 1} or \
        c == {"passed": 1, "failed": 1, "error": 2, "xfailed": 1}, out
    assert out.count("ATOMC_REQUIRE_FIXTURES=1: a skip is a failure here") >= 3, out
    assert "fixture gone" in out and "SmolLM2 not set" in out and "atomc_no_such_reference_package" in out


def fake_binary(build, name, text, rc=0):
    path = build / "tests" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho 'skip x: why' >&2\nprintf '%s\\n' '{text}'\nexit {rc}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_all(build):
    env = dict(os.environ, ATOMC_BUILD=str(build), ATOMC_SKIP_PY="1")
    r = subprocess.run(["bash", os.path.join(ROOT, "tests", "run_all.sh")], capture_output=True, text=True, env=env,
                       timeout=60)
    return r.returncode, r.stdout.strip().splitlines()[-1], r.stdout


def test_run_all_sums_skipped(tmp_path):
    fake_binary(tmp_path, "test_a", "3 passed, 0 failed, 2 skipped")
    fake_binary(tmp_path, "test_b", "1 passed, 0 failed")  # the line before skips were counted
    rc, last, out = run_all(tmp_path)
    assert (rc, last) == (0, "4 passed, 0 failed, 2 skipped"), out
    assert "skip x: why" in out  # a binary's skips are listed with their reasons


def test_run_all_counts_broken_binaries(tmp_path):
    fake_binary(tmp_path, "test_a", "3 passed, 1 failed, 0 skipped", rc=1)
    fake_binary(tmp_path, "test_b", "Segmentation fault", rc=139)  # no summary line
    fake_binary(tmp_path, "test_c", "2 passed, 0 failed, 0 skipped", rc=1)  # non-zero with nothing failed
    rc, last, out = run_all(tmp_path)
    assert rc != 0, out
    assert last == "5 passed, 3 failed, 0 skipped", out
    assert "failing: test_a test_b test_c" in out
