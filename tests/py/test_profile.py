"""Per-step Chrome-trace profiling (--profile-dir): the trace is valid JSON, every begin has a
matching end on the same thread in stack order, and the step phases the engine promises appear."""
import glob
import json
import os
import subprocess

import pytest

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
SMOLLM2 = os.environ.get("ATOMC_SMOLLM2")
TINY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "llama_gqa")


def load_trace(d):
    files = glob.glob(os.path.join(d, "atomc-trace-*.json"))
    assert len(files) == 1, files
    return json.load(open(files[0]))["traceEvents"]


def check_nesting(events):
    stacks = {}
    for e in events:
        st = stacks.setdefault(e["tid"], [])
        if e["ph"] == "B":
            st.append(e["name"])
        elif e["ph"] == "E":
            assert st and st[-1] == e["name"], (st, e)
            st.pop()
    assert all(not s for s in stacks.values())
    ts = [e["ts"] for e in events]
    assert ts == sorted(ts)


def test_generate_profile_on_token_ids(tmp_path):
    out = subprocess.run([ATOMC, "generate", "--model", TINY, "--prompt-ids", "5,6,7,8", "--max-tokens", "6",
                          "--temperature", "0", "--json", "--profile-dir", str(tmp_path / "p")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "profile written to" in out.stderr
    ev = load_trace(tmp_path / "p")
    check_nesting(ev)
    names = {e["name"] for e in ev}
    assert {"schedule", "step", "prepare_inputs", "execute", "postprocess"} <= names
    steps = [e for e in ev if e["name"] == "step" and e["ph"] == "B"]
    assert len(steps) == 6  # one prefill step + 5 decode steps (6 tokens)


@pytest.mark.skipif(not SMOLLM2, reason="ATOMC_SMOLLM2 not set")
def test_profile_records_detokenization(tmp_path):
    out = subprocess.run([ATOMC, "generate", "--model", SMOLLM2, "--prompt", "The sea is", "--max-tokens", "4",
                          "--temperature", "0", "--profile-dir", str(tmp_path / "p")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ev = load_trace(tmp_path / "p")
    check_nesting(ev)
    assert sum(1 for e in ev if e["name"] == "detokenize" and e["ph"] == "B") >= 4


def test_profile_dir_errors_are_clear(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = subprocess.run([ATOMC, "generate", "--model", TINY, "--prompt-ids", "5,6", "--max-tokens", "2",
                          "--profile-dir", str(blocker / "sub")], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "profile directory" in out.stderr
