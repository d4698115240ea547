"""`atomc bench latency` on a tiny model: every batch size gets timed decode steps, even when the
batch's prefill spans many steps, and every prompt length a TTFT."""
import json
import os
import subprocess

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
TINY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "llama_gqa")


def test_latency_reports_every_point(tmp_path):
    out = subprocess.run([ATOMC, "bench", "latency", "--model", TINY, "--batch-sizes", "1,3,24", "--input-len", "40",
                          "--output-len", "6", "--prompt-lens", "16,100", "--num-iters", "2",
                          "--max-num-batched-tokens", "128", "--output-json", str(tmp_path / "l.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.load(open(tmp_path / "l.json"))
    assert [d["batch_size"] for d in r["decode"]] == [1, 3, 24]
    assert all(d["mean_ms"] > 0 and d["median_ms"] > 0 for d in r["decode"])
    assert [p["prompt_len"] for p in r["prefill"]] == [16, 100]
    assert all(p["mean_ms"] > 0 for p in r["prefill"])


def test_latency_rejects_bad_lists():
    out = subprocess.run([ATOMC, "bench", "latency", "--model", TINY, "--batch-sizes", "1,x"], capture_output=True,
                         text=True)
    assert out.returncode == 2
