"""KV-cache scales (compressed-tensors kv_cache_scheme, vLLM's fp8 self_attn.k_scale / v_scale /
kv_scale) against transformers and torch, live:
- transformers (5.x, compressed-tensors 0.20) loads ct_fp8_kv with dequantize=True, reports the
  stored self_attn.k_scale / v_scale as unexpected keys and computes the refs.json logits (KV
  unquantized): it ignores the KV scheme; so the KV reference is built in torch.
- refs_kv.json of every KV fixture is what transformers' fp32 forward (weights = the exact
  dequantization) gives with each layer's post-RoPE K / V fake-quantized with the stored scales
  (tools/make_quant_fixtures.py's atomc_kv attention), recomputed here from the committed files.
- The CLI loads them: --kv-cache-dtype auto is FP8 for ct_fp8_kv and fp8_kv (their kv_cache_scheme)
  with the per-layer scales in use, F32 for fp8_kv_legacy (undeclared kv_scale: unused, said in the
  log), FP8 with --kv-cache-dtype fp8.
The C tests (tests/test_quant_kv.c) compare atomc's logits with refs_kv.json."""
import json
import os
import subprocess
import sys

import pytest

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
QUANT = os.path.join(ROOT, "tests", "fixtures", "quant")
KV_FIXTURES = ["ct_fp8_kv", "fp8_kv", "fp8_kv_legacy", "ct_fp8_kv_hd64"]


def fixture(name):
    path = os.path.join(QUANT, name)
    for f in ("config.json", "model.safetensors", "refs.json", "refs_kv.json"):
        assert os.path.isfile(os.path.join(path, f)), f"fixture {path}/{f} is missing (tools/make_quant_fixtures.py)"
    return path


def tool():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_quant_fixtures
    return make_quant_fixtures


def reference_model(name):
    """The fixture as an fp32 transformers model with the exact dequantized linear weights."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    t = tool()
    path = fixture(name)
    raw = load_file(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        method = json.load(f)["quantization_config"]["quant_method"]
    tensors = {}
    for k, v in raw.items():
        if k.endswith((".k_scale", ".v_scale", ".kv_scale", "weight_scale", "weight_scale_inv")):
            continue
        if t.is_linear(k):
            base = k[:-len("weight")]
            if method == "fp8":
                v = t.fp8_block_dequant(v, raw[base + "weight_scale_inv"])
            else:  # compressed-tensors float-quantized, per channel
                v = v.float() * raw[base + "weight_scale"].float()
        tensors[k] = v
    return t.fresh_ref_model(path, tensors), raw, torch


@pytest.mark.parametrize("name", KV_FIXTURES)
def test_refs_kv_is_torch_fake_quantized_kv(name):
    model, raw, torch = reference_model(name)
    t = tool()
    with open(os.path.join(fixture(name), "refs_kv.json")) as f:
        refs_kv = json.load(f)
    with open(os.path.join(fixture(name), "refs.json")) as f:
        refs = json.load(f)
    ks, vs = {}, {}
    for l in range(model.config.num_hidden_layers):
        p = f"model.layers.{l}.self_attn."
        if p + "kv_scale" in raw:
            ks[l] = vs[l] = raw[p + "kv_scale"].float().item()
        else:
            ks[l], vs[l] = raw[p + "k_scale"].float().item(), raw[p + "v_scale"].float().item()
    assert [ks[l] for l in sorted(ks)] == refs_kv["k_scale"] and [vs[l] for l in sorted(vs)] == refs_kv["v_scale"]
    t._register_kv_attention()
    worst_kv = worst_plain = 0.0
    for p, q, r in zip(refs_kv["prompts"], refs["prompts"], refs["prompts"]):
        ids = torch.tensor([p["ids"]])
        with torch.no_grad():
            plain = model(ids).logits[0].float()
            model.set_attn_implementation("atomc_kv")
            t._KV_HOOK["fn"] = lambda l, w, x: t.fake_quant_kv(x.float(), (ks if w == "k" else vs)[l])
            kv = model(ids).logits[0].float()
            t._KV_HOOK.pop("fn")
            model.set_attn_implementation("eager")
        for i, pos in enumerate(p["logit_positions"]):
            worst_kv = max(worst_kv, (kv[pos] - torch.tensor(p["logits"][i])).abs().max().item())
            worst_plain = max(worst_plain, (plain[pos] - torch.tensor(r["logits"][i])).abs().max().item())
    assert worst_kv < 1e-4, f"{name}: refs_kv.json is {worst_kv} off torch's fake-quantized-KV forward"
    assert worst_plain < 1e-4, f"{name}: refs.json is {worst_plain} off the unquantized-KV forward"


def test_transformers_ignores_the_kv_scales():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    from transformers.utils import logging
    path = fixture("ct_fp8_kv")
    logging.set_verbosity_error()
    m, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                   quantization_config=CompressedTensorsConfig(dequantize=True),
                                                   output_loading_info=True)
    unexpected = set(info["unexpected_keys"])
    assert {"model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"} <= unexpected, info
    with open(os.path.join(path, "refs.json")) as f:
        refs = json.load(f)
    for p in refs["prompts"]:
        with torch.no_grad():
            lg = m(torch.tensor([p["ids"]])).logits[0].float()
        for i, pos in enumerate(p["logit_positions"]):
            # its forward is the unquantized-KV one (refs.json; weights within bf16 rounding)
            assert (lg[pos] - torch.tensor(p["logits"][i])).abs().max().item() < 0.05


@pytest.mark.parametrize("name,kv,want_dtype,used", [("ct_fp8_kv", "auto", "F8_E4M3", True),
                                                     ("ct_fp8_kv", "bf16", "BF16", False),
                                                     ("fp8_kv", "auto", "F8_E4M3", True),
                                                     ("fp8_kv_legacy", "auto", "F32", False),
                                                     ("fp8_kv_legacy", "fp8", "F8_E4M3", True)])
def test_cli_kv_cache_dtype_and_scales(name, kv, want_dtype, used):
    out = subprocess.run([ATOMC, "generate", "--model", fixture(name), "--prompt-ids", "5,6,7", "--max-tokens", "3",
                          "--temperature", "0", "--json", "--kv-cache-dtype", kv, "--cpu-kv-cache-gb", "0.02"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"({want_dtype}" in out.stderr.split("model runner ready")[1], out.stderr
    assert "KV-cache scales: 1 of 1 layers" in out.stderr, out.stderr
    assert ("KV-cache scales are unused" in out.stderr) == (not used), out.stderr
    assert len(json.loads(out.stdout)["ids"]) == 3
