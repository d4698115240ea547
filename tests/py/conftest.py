"""Shared pytest setup for the Python reference tests.

Strict fixtures: under ATOMC_REQUIRE_FIXTURES=1 (set by CI: .ci/run -> scripts/test.sh) every skip
is a failure. Skips here only ever mean that something from outside the repository is missing (the
SmolLM2 GGUF, a tokenizer under ../shared, a reference package such as `openai`, `tokenizers`,
`lm_eval` or `schemathesis`), so CI, which provides all of them, must never see one: a skip there
means a deleted or misplaced file is hiding a test. This covers `pytest.skip`, `skipif` marks and
`pytest.importorskip`, in a test, in a fixture or at module level. Without the switch skips are
counted as usual ("N skipped" in pytest's summary; tests/run_all.sh adds them to its total).
A committed fixture under tests/fixtures is never a reason to skip: tests assert it exists."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def require_fixtures():
    """Whether ATOMC_REQUIRE_FIXTURES is set to anything but "" or "0" (as tests/harness.c reads it)."""
    return os.environ.get("ATOMC_REQUIRE_FIXTURES", "") not in ("", "0")


def _skip_reason(longrepr):
    # A skip's longrepr is (file, line, "Skipped: reason"); anything else is shown as it is.
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return f"{longrepr[2]} ({longrepr[0]}:{longrepr[1]})"
    return str(longrepr)


def _as_failure(report):
    report.longrepr = (f"ATOMC_REQUIRE_FIXTURES=1: a skip is a failure here: {_skip_reason(report.longrepr)}")
    report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if require_fixtures() and report.skipped and not hasattr(report, "wasxfail"):
        _as_failure(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if require_fixtures() and report.skipped:
        _as_failure(report)
