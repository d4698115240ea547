#!/usr/bin/env python3
"""Writes tiny quantized (and quantization-shaped) Llama checkpoints into tests/fixtures/quant/,
in the formats real FP8 / INT4 checkpoints ship in, for the tests that show atomc refuses
what it does not implement (tests/test_quant_refuse.c, tests/py/test_quant_refuse.py):

    (each quantized one also has refs.json: logits and greedy tokens of transformers' dequantized
    model, in tests/fixtures/models' refs format, for the tests of running these schemes)

    fp8_block/           quant_method "fp8", weight_block_size [128, 128], F8_E4M3 weights with
                         F32 weight_scale_inv per 128x128 block (the DeepSeek-V3 / Qwen3-FP8 layout),
                         written here tensor by tensor
    ct_fp8_channel/      compressed-tensors "float-quantized": FP8 weights with per-channel scales,
                         dynamic per-token FP8 activations (llm-compressor's FP8_DYNAMIC)
    ct_w4a16_group128/   compressed-tensors "pack-quantized": INT4 weights packed in int32, group
                         size 128 scales, activations unquantized (W4A16)
    fp8_no_config/       NO quantization_config, yet F8_E4M3 weights with a per-tensor weight_scale
                         next to each: the checkpoint that used to load silently with its scales
                         ignored
    unknown_tensor/      a plain BF16 checkpoint with one extra tensor no Llama layer has

The compressed-tensors fixtures are written by the `compressed-tensors` package itself
(apply_quantization_config, scales from its calculate_qparams over each weight's min/max,
ModelCompressor.compress_model / update_config). Every quantized fixture is then loaded back
with transformers (dequantize=True) and its dequantized weights are checked against the
format's definition (fp8 * scale per block / channel, int4 * scale per group), which proves the
files are what those libraries read. The sizes stay small (hidden 64, or 128 where a group of
128 must fit in a row; one layer; vocabulary 128): each directory is 71-106 KB.

Run (CPU, ~20 s):  python3 tools/make_quant_fixtures.py [--out tests/fixtures/quant]
Needs torch, transformers, compressed-tensors, safetensors (tests/requirements.txt).
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

FP8_MAX = 448.0
BLOCK = 128

# The tiny llama_gqa fixture's config (tools/make_tiny_models.py), cut to one layer and a
# 128-token vocabulary to keep the files small.
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, head_dim=32,
            num_key_value_heads=1, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0)
# W4A16 with groups of 128 needs rows of at least 128 inputs.
BASE_128 = dict(BASE, hidden_size=128, intermediate_size=128, num_attention_heads=2, head_dim=64,
                tie_word_embeddings=True)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def base_model(overrides, seed):
    torch.manual_seed(seed)
    kw = dict(overrides)
    theta = kw.pop("rope_theta")
    cfg = LlamaConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta})
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.1)
    return model.to(torch.bfloat16).eval()


def is_linear(name):
    return any(name.endswith(f".{n}.weight") for n in LINEARS)


def save_plain(model, out):
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    for extra in ("generation_config.json",):
        p = os.path.join(out, extra)
        if os.path.exists(p):
            os.remove(p)


def patch_config(out, **keys):
    p = os.path.join(out, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg.update(keys)
    with open(p, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def fp8_blocks(w):
    """128x128-block FP8 of a float matrix: (F8_E4M3 weight, F32 weight_scale_inv[ceil(r/128), ceil(c/128)])."""
    r, c = w.shape
    gr, gc = -(-r // BLOCK), -(-c // BLOCK)
    scale = torch.empty(gr, gc, dtype=torch.float32)
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            s = max(blk.abs().max().item(), 1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def fp8_block_dequant(q, scale):
    r, c = q.shape
    full = scale.repeat_interleave(BLOCK, 0)[:r].repeat_interleave(BLOCK, 1)[:, :c]
    return q.float() * full


def check_close(name, got, want, tol):
    err = (got.float() - want.float()).abs().max().item()
    ref = want.float().abs().max().item()
    assert err <= tol * max(ref, 1e-6), f"{name}: max |transformers - format definition| = {err} (ref max {ref})"
    return err


def load_dequantized(out, quant_config):
    """The fixture as transformers loads it with dequantize=True (fp32, eager attention)."""
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                quantization_config=quant_config).float().eval()


def refs_from_exact(model, exact, out):
    """refs.json from the transformers model with its linear weights set to the format's exact
    fp32 dequantization (transformers' own may round it to bf16; checked equal up to that)."""
    with torch.no_grad():
        sd = model.state_dict()
        for k, w in exact.items():
            sd[k].copy_(w.float())
    write_refs(model, out)


def write_refs(model, out, lengths=(1, 7), greedy_tokens=4):
    """refs.json in tests/fixtures/models' format (ids, logit_positions, logits, greedy,
    greedy_margins): the reference for running these schemes (weights dequantized exactly,
    activations not quantized, so W8A8 schemes differ from it by their activation rounding)."""
    gen = torch.Generator().manual_seed(99)
    prompts = []
    for n in lengths:
        ids = torch.randint(4, model.config.vocab_size, (1, n), generator=gen)
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        positions = sorted({0, n - 1})
        seq, greedy, margins = ids, [], []
        with torch.no_grad():
            for _ in range(greedy_tokens):
                top2 = torch.topk(model(seq).logits[0, -1].float(), 2)
                greedy.append(int(top2.indices[0]))
                margins.append(round(float(top2.values[0] - top2.values[1]), 6))
                seq = torch.cat([seq, top2.indices[:1].view(1, 1)], dim=1)
        prompts.append(dict(ids=ids[0].tolist(), logit_positions=positions,
                            logits=[[round(float(x), 5) for x in logits[p]] for p in positions], greedy=greedy,
                            greedy_margins=margins))
    with open(os.path.join(out, "refs.json"), "w") as f:
        json.dump(dict(model=os.path.basename(out), generator="tools/make_quant_fixtures.py",
                       reference="transformers (dequantize=True), linear weights = the format's exact fp32 "
                                                         "dequantization, fp32, eager attention, activations unquantized",
                       transformers=__import__("transformers").__version__, prompts=prompts), f,
                  separators=(",", ":"))
        f.write("\n")


# ---------------------------------------------------------------------------------------------

def make_fp8_block(out):
    model = base_model(dict(BASE, intermediate_size=256), 1)  # gate/up/down span 2 blocks
    save_plain(model, out)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors, want = {}, {}
    for k, v in sd.items():
        if is_linear(k):
            q, s = fp8_blocks(v.float())
            tensors[k] = q
            tensors[k[:-len("weight")] + "weight_scale_inv"] = s
            want[k] = fp8_block_dequant(q, s)
        else:
            tensors[k] = v
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    patch_config(out, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                           "weight_block_size": [BLOCK, BLOCK],
                                           "modules_to_not_convert": ["lm_head"]})
    from transformers import FineGrainedFP8Config
    model = load_dequantized(out, FineGrainedFP8Config(weight_block_size=(BLOCK, BLOCK), dequantize=True))
    got = dict(model.state_dict())
    # transformers dequantizes into bf16: compare within bf16 rounding.
    for k, w in want.items():
        check_close(k, got[k], w, 2 ** -8)
        if tensors[k[:-len("weight")] + "weight_scale_inv"].numel() > 1:  # the scale grid matters
            assert (got[k].float() - tensors[k].float() * tensors[k[:-len("weight")] + "weight_scale_inv"][0, 0]
                    ).abs().max() > 1e-3, k
    refs_from_exact(model, want, out)


def make_ct(out, overrides, scheme_kw, fmt, seed, check):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import CompressedTensorsConfig

    model = base_model(overrides, seed)
    original = {k: v.float().clone() for k, v in model.state_dict().items()}
    scheme = QuantizationScheme(targets=["Linear"], **{k: QuantizationArgs(**v) if v else None
                                                       for k, v in scheme_kw.items()})
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    # What llm-compressor's min/max observer does: scales from each channel's (or group's) range.
    with torch.no_grad():
        for name, m in model.named_modules():
            if not hasattr(m, "weight_scale"):
                continue
            args = m.quantization_scheme.weights
            w = m.weight.float()
            if args.group_size:
                w = w.reshape(w.shape[0], -1, args.group_size)
            s, z = calculate_qparams(w.amin(-1), w.amax(-1), args)
            m.weight_scale.copy_(s.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.copy_(z.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(out)
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    model = load_dequantized(out, CompressedTensorsConfig(dequantize=True))
    got = dict(model.state_dict())
    raw = load_file(os.path.join(out, "model.safetensors"))
    exact = {k: check(k, got[k], original[k], raw) for k in original if is_linear(k)}
    refs_from_exact(model, exact, out)


def check_fp8_channel(k, got, orig, raw):
    base = k[:-len("weight")]
    assert raw[k].dtype == torch.float8_e4m3fn, f"{k}: {raw[k].dtype}"
    want = raw[k].float() * raw[base + "weight_scale"].float()
    check_close(k, got, want, 2 ** -8)
    check_close(k + " vs original", got, orig, 2 ** -3)  # FP8 e4m3: 3 mantissa bits
    return want


def check_w4_group(k, got, orig, raw):
    base = k[:-len("weight")]
    packed, scale = raw[base + "weight_packed"], raw[base + "weight_scale"].float()
    assert packed.dtype == torch.int32, f"{base}weight_packed: {packed.dtype}"
    u = packed.view(torch.int32).numpy().view("uint32")
    nib = torch.stack([torch.from_numpy(((u >> (4 * i)) & 0xF).astype("int64")) for i in range(8)], -1)
    q = nib.reshape(packed.shape[0], -1) - 8  # offset-8 nibbles, 8 per int32, low bits first
    want = (q.float().reshape(q.shape[0], -1, 128) * scale[:, :, None]).reshape(q.shape)
    check_close(k, got, want, 2 ** -8)
    check_close(k + " vs original", got, orig, 2 ** -2)  # 4 bits
    return want


def make_fp8_no_config(out):
    """F8_E4M3 weights each with a per-tensor F32 weight_scale, and no quantization_config."""
    model = base_model(BASE, 4)
    save_plain(model, out)
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.contiguous()
        if is_linear(k):
            s = v.float().abs().max() / FP8_MAX
            tensors[k] = (v.float() / s).to(torch.float8_e4m3fn)
            tensors[k[:-len("weight")] + "weight_scale"] = s.reshape(1).float()
        else:
            tensors[k] = v
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def make_unknown_tensor(out):
    model = base_model(BASE, 5)
    save_plain(model, out)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["model.layers.0.self_attn.sinks"] = torch.zeros(BASE["num_attention_heads"], dtype=torch.bfloat16)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant"))
    a = ap.parse_args()
    jobs = {
        "fp8_block": make_fp8_block,
        "ct_fp8_channel": lambda o: make_ct(
            o, BASE, dict(weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False),
                          input_activations=dict(num_bits=8, type="float", strategy="token", symmetric=True,
                                                 dynamic=True)),
            "float-quantized", 2, check_fp8_channel),
        "ct_w4a16_group128": lambda o: make_ct(
            o, BASE_128, dict(weights=dict(num_bits=4, type="int", strategy="group", group_size=128, symmetric=True,
                                           dynamic=False)),
            "pack-quantized", 3, check_w4_group),
        "fp8_no_config": make_fp8_no_config,
        "unknown_tensor": make_unknown_tensor,
    }
    for name, fn in jobs.items():
        out = os.path.join(a.out, name)
        shutil.rmtree(out, ignore_errors=True)
        fn(out)
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        print(f"{name}: {size / 1024:.1f} KB ({', '.join(sorted(os.listdir(out)))})")


if __name__ == "__main__":
    main()
