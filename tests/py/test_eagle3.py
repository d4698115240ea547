"""Speculative method eagle3 end to end on the CPU backend, with the tiny Llama target
tests/fixtures/models/llama_gqa and the EAGLE-3 head tests/fixtures/tiny_eagle3
(tools/make_tiny_eagle3.py):

- the head's references (eagle3_refs.json, which tests/test_eagle3.c holds atomc's draft logits
  and chains to) recomputed from the committed weights with HF transformers' Llama modules, and
  shown to move with each feature atomc must get right (aux layer ids, hidden_norm,
  norm_before_residual, the head's own RoPE), so that test can fail;
- `atomc generate` with vLLM's --speculative-config and ATOM-style --method eagle3
  --speculative-model gives the same tokens and logprobs as without drafts, greedy and seeded
  sampling;
- bad heads are clear errors at start-up, naming what is wrong;
- `atomc serve` with eagle3 returns through the openai client the same completions (token ids,
  greedy and seeded sampling) as without drafts, and /metrics carries vLLM's spec_decode counters."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
FIX = os.path.join(ROOT, "tests", "fixtures")
TARGET = os.path.join(FIX, "models", "llama_gqa")
HEAD = os.path.join(FIX, "tiny_eagle3")
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.dirname(__file__))

PROMPT = "9,9,120,3,250,61,17,88,30"  # a prompt the head was fitted on: drafts get accepted


def run(*args, timeout=300):
    return subprocess.run([ATOMC, *args], capture_output=True, text=True, timeout=timeout)


def gen(model, *args):
    out = run("generate", "--model", model, "--json", "--num-threads", "2", "--cpu-kv-cache-gb", "0.02", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("head_dir", [HEAD, HEAD + "_speculators"])
def test_eagle3_refs_are_the_hf_module_forward(head_dir):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from make_tiny_eagle3 import draft_logits, embedder, load_fixture
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    torch.set_num_threads(1)
    model, head, d2t, ids = load_fixture(head_dir)
    with open(os.path.join(head_dir, "eagle3_refs.json")) as f:
        refs = json.load(f)
    assert ids == refs["aux_layer_ids"] and d2t.tolist() == refs["d2t"]
    emb = embedder(model, head)
    worst = 0.0
    with torch.no_grad():
        for p in refs["prompts"]:
            hid, out, logits = draft_logits(model, head, p["ids"], p["target_next"], ids)
            worst = max(worst, float((logits[0] - torch.tensor(p["draft_logits"])).abs().max()))
            n = len(p["ids"])
            toks, hids, o, lg = p["ids"][1:] + [p["target_next"]], hid[0], out[0], logits[0]
            for j, (d, margin) in enumerate(zip(p["chain"], p["chain_margins"])):
                row = lg[n - 1 + j]
                if margin >= 1e-3:
                    assert int(row.argmax()) + int(d2t[int(row.argmax())]) == d
                toks = toks + [d]
                hids = torch.cat([hids, o[n - 1 + j].view(1, -1)], 0)
                o, lg = head(emb(torch.tensor([toks])), hids.view(1, len(toks), -1))
                o, lg = o[0], lg[0]
        assert worst < 1e-4, worst
        if head_dir != HEAD:
            return
        # Each feature moves the logits far beyond the C test's tolerance (1e-4 of the logit scale).
        p = refs["prompts"][3]
        base = draft_logits(model, head, p["ids"], p["target_next"], ids)[2]
        scale = float(base.abs().max())

        def moved():
            return float((draft_logits(model, head, p["ids"], p["target_next"], ids_used)[2] - base).abs().max())

        ids_used = [0, 1, 2]
        assert moved() > 1e-2 * scale
        ids_used = ids
        head.use_hidden_norm = False
        assert moved() > 1e-2 * scale
        head.use_hidden_norm = True
        head.norm_before_residual = True
        assert moved() > 1e-2 * scale
        head.norm_before_residual = False
        rot, head.rotary = head.rotary, LlamaRotaryEmbedding(model.config)
        assert moved() > 1e-2 * scale
        head.rotary = rot
        assert moved() == 0.0


E3_JSON = '{"method": "eagle3", "model": "%s", "num_speculative_tokens": 3}' % HEAD


@pytest.mark.parametrize("sampling", [["--temperature", "0"],
                                      ["--temperature", "0.8", "--top-k", "20", "--seed", "7",
                                       "--repetition-penalty", "1.1"]])
def test_eagle3_same_tokens_as_plain(sampling):
    # Drafts are the head's argmax (q one-hot): even seeded sampling gives the very same tokens.
    common = ["--prompt-ids", PROMPT, "--max-tokens", "40", "--ignore-eos", "--logprobs", "2", *sampling]
    plain = gen(TARGET, *common)
    spec = gen(TARGET, *common, "--speculative-config", E3_JSON)
    atom = gen(TARGET, *common, "--method", "eagle3", "--speculative-model", HEAD, "--num-speculative-tokens", "2")
    speculators = gen(TARGET, *common, "--method", "eagle3", "--speculative-model", HEAD + "_speculators",
                      "--num-speculative-tokens", "3")
    assert spec["ids"] == plain["ids"]
    assert atom["ids"] == plain["ids"]
    assert speculators["ids"] == plain["ids"]
    for a, b in zip(spec["logprobs"], plain["logprobs"]):
        assert abs(a["logprob"] - b["logprob"]) < 1e-3


def test_eagle3_acceptance_in_bench_throughput(tmp_path):
    js = tmp_path / "tp.json"
    out = run("bench", "throughput", "--model", TARGET, "--num-prompts", "4", "--input-len", "16", "--output-len", "16",
              "--cpu-kv-cache-gb", "0.02", "--num-threads", "2", "--speculative-config", E3_JSON,
              "--output-json", str(js))
    assert out.returncode == 0, out.stderr
    assert "Speculative decoding (eagle3, k=3):" in out.stdout
    j = json.loads(js.read_text())
    assert j["num_speculative_tokens"] == 3 and j["spec_num_draft_tokens"] > 0


def head_copy(tmp_path, name, edit=None, tensors=None):
    """A copy of the head with config.json edited and (optionally) model.safetensors rewritten."""
    d = tmp_path / name
    shutil.copytree(HEAD, d)
    if edit:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors:
        st = pytest.importorskip("safetensors.torch")
        t = st.load_file(str(d / "model.safetensors"))
        tensors(t)
        st.save_file(t, str(d / "model.safetensors"))
    return str(d)


def refused(tmp_path, head, msg, target=TARGET):
    cfg = '{"method": "eagle3", "model": "%s", "num_speculative_tokens": 2}' % head
    out = run("generate", "--model", target, "--prompt-ids", "1,2,3", "--cpu-kv-cache-gb", "0.02",
              "--speculative-config", cfg)
    assert out.returncode != 0
    assert msg in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "Assertion" not in out.stderr and "CHECK" not in out.stderr


def test_bad_eagle3_heads_are_clear_errors(tmp_path):
    refused(tmp_path, HEAD, "EAGLE-3 heads are implemented for LlamaForCausalLM targets only",
            target=os.path.join(FIX, "models", "qwen3"))
    refused(tmp_path, str(tmp_path / "nowhere"), "no readable config.json in the EAGLE-3 head directory")
    refused(tmp_path, head_copy(tmp_path, "hidden", lambda c: c.update(target_hidden_size=4096)),
            "trained for a target of hidden size 4096")
    refused(tmp_path, head_copy(tmp_path, "width", lambda c: c.update(hidden_size=128)), "has hidden size 128")
    refused(tmp_path, head_copy(tmp_path, "layers", lambda c: c.update(num_hidden_layers=2)), "2 decoder layers")
    refused(tmp_path, head_copy(tmp_path, "bias", lambda c: c.update(attention_bias=True)), "biases")
    refused(tmp_path, head_copy(tmp_path, "arch", lambda c: c.update(architectures=["MedusaModel"])),
            "declares architecture 'MedusaModel'")
    corrupt = head_copy(tmp_path, "corrupt")
    with open(os.path.join(corrupt, "model.safetensors"), "r+b") as f:
        f.truncate(1000)
    refused(tmp_path, corrupt, "model.safetensors")
    pt = head_copy(tmp_path, "pt")
    os.rename(os.path.join(pt, "model.safetensors"), os.path.join(pt, "pytorch_model.bin"))
    refused(tmp_path, pt, "pytorch_model.bin, which is not read (convert it to safetensors)")
    pytest.importorskip("torch")
    refused(tmp_path, head_copy(tmp_path, "missing", tensors=lambda t: t.pop("midlayer.hidden_norm.weight")),
            "midlayer.hidden_norm.weight")
    refused(tmp_path, head_copy(tmp_path, "extra", tensors=lambda t: t.update({"midlayer.foo.weight": t["norm.weight"].clone()})),
            "midlayer.foo.weight")
    refused(tmp_path, head_copy(tmp_path, "d2t", tensors=lambda t: t["d2t"].add_(1000)), "d2t[0]")


@pytest.mark.parametrize("cfg,msg", [
    ('{"method": "eagle3", "num_speculative_tokens": 2}', 'needs the EAGLE-3 head\'s directory'),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', 'belongs to method "eagle3"'),
    ('{"method": "eagle3", "num_speculative_tokens": 2, "model": 7}', '"model" must be a non-empty path'),
])
def test_bad_eagle3_configs(cfg, msg):
    out = run("generate", "--model", TARGET, "--prompt-ids", "1,2,3", "--cpu-kv-cache-gb", "0.02",
              "--speculative-config", cfg)
    assert out.returncode != 0
    assert msg in out.stderr, out.stderr


# ---------------------------------------------------------------- atomc serve with eagle3 drafts

def target_with_tokenizer(tmp_path):
    """llama_gqa plus a byte-level BPE tokenizer of its 256 ids (no merges), so `atomc serve` loads."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers
    d = tmp_path / "llama_gqa_tok"
    shutil.copytree(TARGET, d)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    assert len(vocab) == 256
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    return str(d)


def test_serve_with_eagle3_same_completions_and_metrics(tmp_path):
    openai = pytest.importorskip("openai")
    from server_util import Server
    model = target_with_tokenizer(tmp_path)
    outs = {}
    for name, extra in [("plain", []), ("eagle3", ["--speculative-config", E3_JSON]),
                        ("atom", ["--method", "eagle3", "--speculative-model", HEAD, "--num-speculative-tokens", "2"])]:
        s = Server(model, "--max-model-len", "128", "--max-num-seqs", "4", "--num-threads", "2", *extra)
        try:
            c = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=120)
            mid = c.models.list().data[0].id
            got = []
            for kw in [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=11)]:
                r = c.completions.create(model=mid, prompt=[int(x) for x in PROMPT.split(",")], max_tokens=24,
                                         logprobs=1, extra_body={"return_tokens_as_token_ids": True,
                                                                 "ignore_eos": True}, **kw)
                got.append((r.choices[0].logprobs.tokens, r.choices[0].finish_reason, r.usage.completion_tokens))
            outs[name] = got
            m = s.metrics()
            if name != "plain":
                assert s.metric("vllm:spec_decode_num_drafts_total") > 0
                acc = s.metric("vllm:spec_decode_num_accepted_tokens_total")
                assert 0 < acc <= s.metric("vllm:spec_decode_num_draft_tokens_total")
            else:
                assert not any("spec_decode" in k for k in m)
        finally:
            assert s.stop() == 0, s.read_log()
    assert outs["eagle3"] == outs["plain"]
    assert outs["atom"] == outs["plain"]
    assert all(len(toks) == 24 for toks, _, _ in outs["plain"])


def test_eagle3_head_from_the_hf_cache(tmp_path):
    # "model": "ORG/NAME" (as vLLM users give yuhuili/EAGLE3-...) is the head's snapshot in the HF cache.
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-eagle3"
    snap = repo / "snapshots" / rev
    os.makedirs(snap)
    os.makedirs(repo / "refs")
    (repo / "refs" / "main").write_text(rev)
    for f in os.listdir(HEAD):
        shutil.copy(os.path.join(HEAD, f), snap / f)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")}
    env["HF_HUB_CACHE"] = str(tmp_path / "hub")
    common = ["generate", "--model", TARGET, "--json", "--num-threads", "2", "--cpu-kv-cache-gb", "0.02",
              "--prompt-ids", PROMPT, "--max-tokens", "16", "--ignore-eos"]
    plain = subprocess.run([ATOMC, *common], capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 0, plain.stderr
    for extra in (["--speculative-config", '{"method": "eagle3", "model": "tiny-org/tiny-eagle3", '
                                           '"num_speculative_tokens": 3}'],
                  ["--method", "eagle3", "--speculative-model", "tiny-org/tiny-eagle3", "--num-speculative-tokens", "2"]):
        out = subprocess.run([ATOMC, *common, *extra], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["ids"] == json.loads(plain.stdout)["ids"]
    out = subprocess.run([ATOMC, *common, "--method", "eagle3", "--speculative-model", "tiny-org/absent",
                          "--num-speculative-tokens", "2"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and "tiny-org/absent" in out.stderr, out.stderr


def test_eagle3_random_head_for_benchmarks(tmp_path):
    # BENCHMARK ONLY: a bare head config (bench/configs/eagle3_*.json) over a dummy target is a
    # random head whose passes run for real while --spec-forced-acceptance decides the drafts.
    bench = ["bench", "throughput", "--model", os.path.join(TARGET, "config.json"), "--load-format", "dummy",
             "--num-prompts", "4", "--input-len", "16", "--output-len", "16", "--cpu-kv-cache-gb", "0.02",
             "--num-threads", "2", "--spec-forced-acceptance", "0.7"]
    bare = '{"method": "eagle3", "model": "%s", "num_speculative_tokens": 3}' % os.path.join(HEAD, "config.json")
    out = run(*bench, "--speculative-config", bare)
    assert out.returncode == 0, out.stderr
    assert "with random weights" in out.stderr
    assert "Speculative decoding (eagle3, k=3):" in out.stdout
    out = run(*bench, "--speculative-config", E3_JSON)  # a trained head over random target weights
    assert out.returncode != 0 and "takes a bare head config" in out.stderr, out.stderr
    out = run("generate", "--model", TARGET, "--prompt-ids", "1,2,3", "--cpu-kv-cache-gb", "0.02",
              "--speculative-config", bare)  # a random head over the real target
    assert out.returncode != 0 and "needs --load-format dummy" in out.stderr, out.stderr
