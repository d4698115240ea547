"""`atomc serve` start-up refusals that name the problem and exit (no half-started server)."""
import os
import shutil
import subprocess

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_bare_config_needs_a_tokenizer(tmp_path):
    cfg = str(tmp_path / "tiny.json")  # a bare config as bench/configs/*.json are, of a tiny model
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "models", "llama_gqa", "config.json"), cfg)
    out = subprocess.run([ATOMC, "serve", "--model", cfg, "--load-format", "dummy", "--port", "1",
                          "--max-model-len", "64", "--kv-cache-memory-bytes", "8M"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "the server needs a tokenizer" in out.stderr and "bare config.json" in out.stderr, out.stderr
    assert "atomc is serving" not in out.stderr
