"""`atomc inspect` over the loader: config read from GGUF metadata must equal what HF
transformers derives from the same file (recorded in tests/fixtures/loader/tiny_*_refs.json by
tools/gen_loader_refs.py), and bad inputs must fail with the loader's message, not a crash."""
import json
import os
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BIN = os.environ.get("ATOMC_BIN", os.path.join(ROOT, "build", "atomc"))
FIX = os.path.join(ROOT, "tests", "fixtures")


def inspect(*args):
    return subprocess.run([BIN, "inspect", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3"])
def test_gguf_config_matches_transformers(name):
    r = inspect("--model", os.path.join(FIX, "loader", f"{name}.gguf"), "--json", "--tensors")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    ref = json.load(open(os.path.join(FIX, "loader", f"{name}_refs.json")))["config"]
    assert got["format"] == "gguf"
    assert got["hidden_size"] == ref["hidden_size"]
    assert got["num_heads"] == ref["num_attention_heads"]
    assert got["num_kv_heads"] == ref["num_key_value_heads"]
    assert got["num_layers"] == ref["num_hidden_layers"]
    assert got["vocab_size"] == ref["vocab_size"]
    assert got["rope_theta"] == ref["rope_theta"]
    assert got["tie_word_embeddings"] == ref["tie_word_embeddings"]
    if "head_dim" in ref:
        assert got["head_dim"] == ref["head_dim"]
    names = {t["name"] for t in got["tensors"]}
    assert "token_embd.weight" in names and len(names) == got["n_tensors"]


def test_hf_directory(tmp_path):
    cfg = json.load(open(os.path.join(FIX, "configs", "smollm2-135m-instruct.json")))
    cfg.update(num_hidden_layers=1, hidden_size=8, intermediate_size=16, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    import struct
    hdr = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + bytes(128))
    r = inspect("--model", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["format"] == "hf" and got["architecture"] == "LlamaForCausalLM"
    assert got["tie_word_embeddings"] is True and got["eos_token_ids"] == [2]
    assert got["weight_bytes"] == 128


def test_bad_inputs_fail_cleanly(tmp_path):
    r = inspect("--model", str(tmp_path))
    assert r.returncode == 1 and "config.json" in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(open(os.path.join(FIX, "loader", "tiny_llama.gguf"), "rb").read()[:5000])
    r = inspect("--model", str(bad))
    assert r.returncode == 1 and "bad.gguf" in r.stderr and "truncated" in r.stderr
    r = inspect("--bogus")
    assert r.returncode == 2
