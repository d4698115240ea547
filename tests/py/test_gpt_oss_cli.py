"""GPT-OSS through the CLI on the CPU backend: `atomc generate` on the tiny MXFP4 fixture (greedy
tokens equal the HF transformers references of tools/make_tiny_gpt_oss.py, which come from
transformers' own MXFP4 dequantization), and `bench throughput` / `bench-runner` with dummy
weights on a scaled-down copy of bench/configs/gpt_oss_20b.json (its mxfp4 quantization_config
kept: the dummy experts are MXFP4, the start-up log says so)."""
import json
import os
import subprocess

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FIX = os.path.join(ROOT, "tests", "fixtures", "models")


def run(*args, timeout=300):
    return subprocess.run([ATOMC, *args], capture_output=True, text=True, timeout=timeout)


def small_config(tmp_path):
    with open(os.path.join(ROOT, "bench", "configs", "gpt_oss_20b.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], hidden_size=256,
               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
               vocab_size=1024, sliding_window=16, eos_token_id=2, pad_token_id=0)
    p = tmp_path / "gpt_oss_small.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_generate_gpt_oss_mxfp4_greedy_matches_hf():
    for name in ("gpt_oss", "gpt_oss_mxfp4"):
        d = os.path.join(FIX, name)
        with open(os.path.join(d, "refs.json")) as f:
            refs = json.load(f)
        p = refs["prompts"][3]  # 37 tokens: crosses the window of 8
        out = run("generate", "--model", d, "--prompt-ids", ",".join(map(str, p["ids"])), "--max-tokens", "12",
                  "--temperature", "0", "--ignore-eos", "--num-threads", "2", "--json")
        assert out.returncode == 0, out.stderr
        ids = json.loads(out.stdout.strip().splitlines()[-1])["ids"]
        for k, (got, want, margin) in enumerate(zip(ids, p["greedy"], p["greedy_margins"])):
            if margin < 1e-3:
                break
            assert got == want, f"{name} step {k}: {got} != HF {want}"


def test_bench_gpt_oss_dummy_mxfp4(tmp_path):
    cfg = small_config(tmp_path)
    out = run("bench", "throughput", "--model", cfg, "--load-format", "dummy", "--num-prompts", "4",
              "--input-len", "24", "--output-len", "5", "--num-threads", "2", "--cpu-kv-cache-gb", "0.02",
              "--moe-uniform-routing")
    assert out.returncode == 0, out.stderr
    assert "Total num output tokens:  20" in out.stdout
    out = run("bench-runner", "--model", cfg, "--load-format", "dummy", "--batch", "2", "--prompt-len", "8",
              "--decode-steps", "3", "--warmup", "1", "--threads", "2", "--moe-uniform-routing")
    assert out.returncode == 0, out.stderr
    assert "mx-quantized" in out.stderr
