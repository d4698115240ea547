"""Speculative decoding flags end to end on the CPU backend (`atomc generate`, `atomc bench
throughput`): vLLM's --speculative-config and ATOM's --method / --num-speculative-tokens give the
same tokens (and logprobs, up to fp32 summation order) as no speculation, greedy and seeded
sampling; bad configurations get a clear error; bench throughput reports the acceptance; `atomc
serve` with drafts returns the same text (greedy, seeded sampling, a stop string) as without and
exposes vLLM's spec_decode counters on /metrics (SmolLM2, $ATOMC_SMOLLM2; skipped without it)."""
import json
import os
import subprocess

import pytest

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models")


def run(*args, timeout=300):
    return subprocess.run([ATOMC, *args], capture_output=True, text=True, timeout=timeout)


def gen(model, *args):
    out = run("generate", "--model", model, "--json", "--num-threads", "2", "--cpu-kv-cache-gb", "0.02", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# A copy-heavy prompt for the tiny models: a pattern repeated, so prompt lookup proposes drafts.
PATTERN = ",".join(str(3 + (i % 7) * 11) for i in range(42))
SPEC_JSON = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3", "mixtral"])
@pytest.mark.parametrize("sampling", [["--temperature", "0"],
                                      ["--temperature", "0.8", "--top-k", "20", "--seed", "7",
                                       "--repetition-penalty", "1.1"]])
def test_ngram_same_tokens_as_plain(name, sampling):
    model = os.path.join(FIX, name)
    common = ["--prompt-ids", PATTERN, "--max-tokens", "40", "--ignore-eos", "--logprobs", "2", *sampling]
    plain = gen(model, *common)
    spec = gen(model, *common, "--speculative-config", SPEC_JSON)
    atom = gen(model, *common, "--method", "ngram", "--num-speculative-tokens", "3")
    assert spec["ids"] == plain["ids"]
    assert atom["ids"] == plain["ids"]
    assert spec["finish_reason"] == plain["finish_reason"] == "length"
    for a, b in zip(spec["logprobs"], plain["logprobs"]):
        assert abs(a["logprob"] - b["logprob"]) < 1e-3


@pytest.mark.parametrize("sampling", [["--temperature", "0"],
                                      ["--temperature", "0.8", "--top-k", "20", "--seed", "7"]])
def test_mtp_same_tokens_as_plain(sampling):
    # deepseek_v3_mtp (tools/make_tiny_mtp.py): greedy MTP drafts keep even seeded sampling exact.
    model = os.path.join(FIX, "deepseek_v3_mtp")
    common = ["--prompt-ids", PATTERN, "--max-tokens", "40", "--ignore-eos", "--logprobs", "2", *sampling]
    plain = gen(model, *common)
    spec = gen(model, *common, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}')
    atom = gen(model, *common, "--method", "mtp", "--num-speculative-tokens", "2")
    assert spec["ids"] == plain["ids"]
    assert atom["ids"] == plain["ids"]
    for a, b in zip(spec["logprobs"], plain["logprobs"]):
        assert abs(a["logprob"] - b["logprob"]) < 1e-3


@pytest.mark.parametrize("cfg,msg", [
    ('{"method": "mtp", "num_speculative_tokens": 1}', "MTP layers are not implemented for LlamaForCausalLM"),
    ('{"method": "eagle3", "num_speculative_tokens": 1}', 'speculative method "eagle3" needs the EAGLE-3 head'),
    ('{"method": "eagle", "num_speculative_tokens": 1}', 'speculative method "eagle" is not implemented yet'),
    ('{"method": "ngram"}', "num_speculative_tokens must be in 1..16, got 0"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', 'belongs to method "eagle3"'),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}',
     'unsupported key "draft_tensor_parallel_size"'),
    ('{"method": "ngram", "num_speculative_tokens": 99}', '"num_speculative_tokens" must be an integer in [1, 16]'),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min (5) is larger than prompt_lookup_max (2)"),
    ('{"num_speculative_tokens": 2}', 'needs a "method"'),
    ('[1, 2]', "expects a JSON object"),
    ('{"method": "ngram",', "expects a JSON object"),
])
def test_bad_speculative_config_is_a_clear_error(cfg, msg):
    out = run("generate", "--model", os.path.join(FIX, "llama_gqa"), "--prompt-ids", "1,2,3",
              "--cpu-kv-cache-gb", "0.02", "--speculative-config", cfg)
    assert out.returncode != 0
    assert msg in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "Assertion" not in out.stderr


def test_bench_throughput_reports_acceptance(tmp_path):
    js = tmp_path / "tp.json"
    out = run("bench", "throughput", "--model", os.path.join(FIX, "llama_gqa"), "--num-prompts", "8",
              "--input-len", "32", "--output-len", "13", "--cpu-kv-cache-gb", "0.02", "--num-threads", "2",
              "--method", "ngram", "--num-speculative-tokens", "3", "--spec-forced-acceptance", "1",
              "--output-json", str(js))
    assert out.returncode == 0, out.stderr
    assert "Speculative decoding (ngram, k=3):" in out.stdout
    assert "accepted (100.00%), mean acceptance length 4.00" in out.stdout
    j = json.loads(js.read_text())
    assert j["num_speculative_tokens"] == 3
    assert j["spec_num_accepted_tokens"] == j["spec_num_draft_tokens"] > 0
    assert j["mean_acceptance_length"] == pytest.approx(4.0)
    assert j["total_num_output_tokens"] == 8 * 13  # 1 from the prefill + 3 steps of 3 drafts + 1


# ---------------------------------------------------------------- atomc serve with ngram drafts

COPY_PROMPT = ("Repeat the following paragraph exactly.\n\nThe old lighthouse stood at the edge of the cliff, "
               "its white paint peeling in long strips. Every night the keeper climbed the ninety-nine steps to "
               "light the lamp.\n\nRepeated paragraph:\n\nThe old lighthouse")


def test_serve_with_ngram_same_text_and_metrics():
    from server_util import SMOLLM2, Server
    if not SMOLLM2:
        pytest.skip("set ATOMC_SMOLLM2 to the SmolLM2-135M-Instruct GGUF")
    outs = {}
    for name, extra in [("plain", []),
                        ("ngram", ["--speculative-config",
                                   '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                   '"prompt_lookup_max": 4}'])]:
        s = Server(SMOLLM2, "--max-model-len", "512", "--max-num-seqs", "4", *extra)
        try:
            texts = []
            for body in [{"prompt": COPY_PROMPT, "max_tokens": 40, "temperature": 0},
                         {"prompt": COPY_PROMPT, "max_tokens": 40, "temperature": 0.7, "seed": 11, "top_p": 0.9},
                         {"prompt": COPY_PROMPT, "max_tokens": 24, "temperature": 0, "stop": ["steps"]}]:
                status, j = s.json("POST", "/v1/completions", body)
                assert status == 200, j
                texts.append((j["choices"][0]["text"], j["choices"][0]["finish_reason"],
                              j["usage"]["completion_tokens"]))
            outs[name] = texts
            m = s.metrics()
            if name == "ngram":
                assert s.metric("vllm:spec_decode_num_drafts_total") > 0
                acc = s.metric("vllm:spec_decode_num_accepted_tokens_total")
                assert acc > 10
                assert acc <= s.metric("vllm:spec_decode_num_draft_tokens_total")
                assert s.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
            else:
                assert not any("spec_decode" in k for k in m)
        finally:
            assert s.stop() == 0, s.read_log()
    assert outs["ngram"] == outs["plain"]
