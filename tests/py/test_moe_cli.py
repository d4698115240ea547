"""MoE models through the CLI on the CPU backend: `atomc generate` on the tiny Qwen3-MoE fixture
(greedy tokens equal HF transformers' references from tools/make_tiny_moe_models.py), and the
benchmark plumbing the Qwen3-30B-A3B runs use on the GPU machine, on a scaled-down copy of
bench/configs/qwen3_30b_a3b.json: a bare config .json with --load-format dummy for
`bench throughput` and `bench-runner`, with and without --moe-uniform-routing."""
import json
import os
import subprocess

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FIX = os.path.join(ROOT, "tests", "fixtures", "models")


def run(*args, env=None, timeout=300):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([ATOMC, *args], capture_output=True, text=True, timeout=timeout, env=e)


def small_config(tmp_path):
    with open(os.path.join(ROOT, "bench", "configs", "qwen3_30b_a3b.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, num_experts=16, moe_intermediate_size=64, vocab_size=1024,
               bos_token_id=1, eos_token_id=2)
    p = tmp_path / "qwen3_moe_small.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_generate_qwen3_moe_greedy_matches_hf():
    d = os.path.join(FIX, "qwen3_moe")
    with open(os.path.join(d, "refs.json")) as f:
        refs = json.load(f)
    p = refs["prompts"][2]
    out = run("generate", "--model", d, "--prompt-ids", ",".join(map(str, p["ids"])), "--max-tokens", "8",
              "--temperature", "0", "--ignore-eos", "--num-threads", "2", "--json")
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout.strip().splitlines()[-1])["ids"]
    # Equal up to the first step whose HF top-2 margin is not clearly above fp32 noise.
    for k, (got, want, margin) in enumerate(zip(ids, p["greedy"], p["greedy_margins"])):
        if margin < 1e-3:
            break
        assert got == want, f"step {k}: {got} != HF {want}"


def test_bench_throughput_bare_moe_config(tmp_path):
    cfg = small_config(tmp_path)
    for extra in ([], ["--moe-uniform-routing"]):
        out = run("bench", "throughput", "--model", cfg, "--load-format", "dummy", "--num-prompts", "6",
                  "--input-len", "24", "--output-len", "5", "--num-threads", "2", "--cpu-kv-cache-gb", "0.02",
                  *extra)
        assert out.returncode == 0, out.stderr
        assert "Total num prompt tokens:  144" in out.stdout
        assert "Total num output tokens:  30" in out.stdout


def test_bench_runner_reports_active_expert_bytes(tmp_path):
    cfg = small_config(tmp_path)
    mib = {}
    for batch in (1, 4):
        out = run("bench-runner", "--model", cfg, "--load-format", "dummy", "--batch", str(batch), "--prompt-len",
                  "8", "--decode-steps", "4", "--warmup", "1", "--threads", "2", "--moe-uniform-routing")
        assert out.returncode == 0, out.stderr
        line = [l for l in out.stdout.splitlines() if l.startswith("moe ")][0]
        mib[batch] = float(line.split()[1])
    # 2 MoE layers of 16 experts (3 * 256 * 64 F32 weights each): batch 4 touches 16 experts per
    # layer (4 * 8), batch 1 touches 8, so the difference is 2 layers * 8 experts of 196,608 bytes.
    diff = (mib[4] - mib[1]) * 1048576
    assert abs(diff - 2 * 8 * 3 * 256 * 64 * 4) < 0.2 * 1048576
