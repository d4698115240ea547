"""Quantized safetensors checkpoints run end to end on the CPU through the CLI: `atomc generate`
(greedy) reproduces the greedy tokens of each fixture's refs.json (transformers' fp32 forward
with the exactly dequantized weights) wherever the refs' top-2 margin is clear — for the W8A8
fixtures, whose activations atomc quantizes as their configs say, refs_w8a8.json
(tools/make_w8a8_refs.py: the same forward with torch's fp8 rounding of the activations) with a
larger margin, since a single activation near an e4m3 rounding midpoint may round the other way
(fp32 summation order) and move these tiny models' logits by up to ~0.09 — and the start-up
log reports the weights kept quantized. Tensor parallelism of quantized weights is refused by
name. Fixtures: tests/fixtures/quant (tools/make_quant_fixtures.py); a missing one fails."""
import json
import os
import re
import socket
import subprocess

import pytest

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
QUANT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant")
FIXTURES = ["fp8_block", "ct_fp8_channel", "ct_fp8_tensor", "ct_w4a16_group128", "ct_w4a16_channel",
            "ct_w8a16_group128", "qwen3_moe_fp8_block",
            # issue 19 part 3: zero points, GPTQ / AWQ, int-quantized, static activation scales
            "ct_w4a16_asym_group32", "gptq_w4_g32_asym_desc_act", "gptq_w8_channel_asym", "awq_w4_g32",
            "ct_w8a8_int8_token", "ct_w8a8_int8_static", "ct_fp8_static_tensor", "fp8_static"]
SCHEME = {"fp8_block": "block", "ct_fp8_channel": "per-channel", "ct_fp8_tensor": "per-tensor",  # (fused parts: per-channel, listed after)
          "ct_w4a16_group128": "group", "ct_w4a16_channel": "group", "ct_w8a16_group128": "group",
          "qwen3_moe_fp8_block": "block", "ct_w4a16_asym_group32": "group", "gptq_w4_g32_asym_desc_act": "group",
          "gptq_w8_channel_asym": "group", "awq_w4_g32": "group", "ct_w8a8_int8_token": "group",
          "ct_w8a8_int8_static": "group", "ct_fp8_static_tensor": "per-tensor", "fp8_static": "per-tensor"}
MIN_MARGIN = 2e-3  # refs' top-2 margin below which fp32 summation order may flip the argmax
W8A8 = {"fp8_block", "ct_fp8_channel", "ct_fp8_tensor", "qwen3_moe_fp8_block",  # refs_w8a8.json
        "ct_w8a8_int8_token", "ct_w8a8_int8_static", "ct_fp8_static_tensor", "fp8_static"}
W8A8_MIN_MARGIN = 1e-2


def fixture(name):
    path = os.path.join(QUANT, name)
    for f in ("config.json", "model.safetensors", "refs.json"):
        assert os.path.isfile(os.path.join(path, f)), f"fixture {path}/{f} is missing (tools/make_quant_fixtures.py)"
    return path


@pytest.mark.parametrize("name", FIXTURES)
def test_generate_greedy_matches_refs(name):
    model = fixture(name)
    with open(os.path.join(model, "refs_w8a8.json" if name in W8A8 else "refs.json")) as f:
        refs = json.load(f)
    min_margin = W8A8_MIN_MARGIN if name in W8A8 else MIN_MARGIN
    checked = 0
    for p in refs["prompts"]:
        out = subprocess.run([ATOMC, "generate", "--model", model, "--prompt-ids", ",".join(map(str, p["ids"])),
                              "--max-tokens", str(len(p["greedy"])), "--temperature", "0", "--json",
                              "--cpu-kv-cache-gb", "0.02"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)["ids"]
        for k, (g, want, margin) in enumerate(zip(got, p["greedy"], p["greedy_margins"])):
            if margin < min_margin:
                break
            assert g == want, f"{name} prompt {p['ids']}: step {k}: {g} != {want} (margin {margin})"
            checked += 1
        m = re.search(r"weights: ([0-9.]+) MiB as F32 \(of them ([0-9.]+) MiB ([a-z-]+)-quantized", out.stderr)
        assert m, out.stderr
        assert m.group(3) == SCHEME[name], out.stderr
    assert checked >= len(refs["prompts"]) * 2, f"{name}: only {checked} steps compared"


STORED = {"fp8_block": "block", "ct_fp8_channel": "per-channel", "ct_fp8_tensor": "per-tensor",
          "ct_w4a16_group128": "group", "ct_w4a16_channel": "group", "ct_w8a16_group128": "group",
          "qwen3_moe_fp8_block": "block", "ct_w4a16_asym_group32": "group", "gptq_w4_g32_asym_desc_act": "group",
          "gptq_w8_channel_asym": "group", "awq_w4_g32": "group", "ct_w8a8_int8_token": "group",
          "ct_w8a8_int8_static": "group", "ct_fp8_static_tensor": "per-tensor", "fp8_static": "per-tensor"}


@pytest.mark.parametrize("name", FIXTURES)
def test_inspect_shows_each_weight_scheme(name):
    model = fixture(name)
    out = subprocess.run([ATOMC, "inspect", "--model", model, "--json", "--tensors"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    tensors = json.loads(out.stdout)["tensors"]
    names = {t["name"] for t in tensors}
    quantized = 0
    for t in tensors:
        base = t["name"].rsplit(".", 1)[0]
        has_scale = any(base + s in names for s in (".weight_scale", ".weight_scale_inv", ".scales"))
        values = (t["name"].endswith(".weight_packed") or t["name"].endswith(".qweight") or  # GPTQ / AWQ
                  (t["name"].endswith(".weight") and t["dtype"] in ("F8_E4M3", "I8")))
        if values and has_scale:
            assert t["scheme"] == STORED[name], t
            quantized += 1
        else:
            assert t["scheme"] is None, t
    assert quantized == (63 if "moe" in name else 7)
    text = subprocess.run([ATOMC, "inspect", "--model", model], capture_output=True, text=True, timeout=60).stdout
    assert f"weight schemes: {STORED[name]} x{quantized} (" in text, text


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_quantized_is_refused():
    model = fixture("fp8_block")
    out = subprocess.run([ATOMC, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(free_port()),
                          "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode > 0, out.stderr
    assert "tensor-parallel shards of quantized weights (scheme block" in out.stderr, out.stderr
    assert "atomc is serving" not in out.stderr
