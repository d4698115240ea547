"""Sizes derived from a model file's counts are computed without overflow (issue 28 item 9): a
config.json whose max_position_embeddings is 2^31-1 gets a clear out-of-memory error with the true
sizes, not a wrapped-around byte count. Random weights (--load-format dummy), no model download."""
import json
import re
import subprocess

from server_util import ATOMC_BIN


def test_context_length_2_31_minus_1_reports_true_sizes(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
           "max_position_embeddings": 2**31 - 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "hidden_act": "silu", "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # One sequence keeps the per-sequence block table at 512 MiB; the KV cache (1 TiB) cannot be had.
    r = subprocess.run([ATOMC_BIN, "generate", "--model", str(tmp_path), "--load-format", "dummy",
                        "--max-num-seqs", "1", "--prompt-ids", "1,2,3", "--max-tokens", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert "KV" in last or "max_model_len" in last, last
    numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", last)]
    assert numbers and max(numbers) < 2**53, last  # a wrapped size would be ~1.8e19
    assert "134217727 blocks" in last or "2147483647" in last, last
