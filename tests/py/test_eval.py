"""`atomc eval perplexity` against HF transformers' perplexity of the same model and text computed
the same way (tests/fixtures/eval/ppl_ref.json, from tools/gen_ppl_ref.py): within 0.5%."""
import json
import os
import subprocess

import pytest

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
SMOLLM2 = os.environ.get("ATOMC_SMOLLM2")
FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "eval")


@pytest.mark.skipif(not SMOLLM2, reason="ATOMC_SMOLLM2 not set")
def test_perplexity_matches_hf():
    ref = json.load(open(os.path.join(FIX, "ppl_ref.json")))
    out = subprocess.run([ATOMC, "eval", "perplexity", "--model", SMOLLM2, "--file",
                          os.path.join(FIX, ref["text"]), "--ctx", str(ref["ctx"]), "--stride", str(ref["stride"]),
                          "--json"], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n_tokens"] == ref["n_tokens"]
    assert got["n_scored"] == ref["n_scored"]
    assert abs(got["perplexity"] - ref["perplexity"]) <= 0.005 * ref["perplexity"], (got, ref["perplexity"])


def test_perplexity_rejects_bad_arguments(tmp_path):
    out = subprocess.run([ATOMC, "eval", "perplexity", "--model", "x"], capture_output=True, text=True)
    assert out.returncode == 2 and "--file" in out.stderr
    out = subprocess.run([ATOMC, "eval", "perplexity", "--model", "x", "--file", "y", "--ctx", "8", "--stride", "9"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "stride" in out.stderr
    missing = tmp_path / "missing.txt"
    out = subprocess.run([ATOMC, "eval", "perplexity", "--model", "x", "--file", str(missing)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "missing.txt" in out.stderr
    out = subprocess.run([ATOMC, "eval", "unknown"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown evaluation" in out.stderr
