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
    ct_fp8_tensor/       compressed-tensors "float-quantized": FP8 weights with one scale per tensor,
                         dynamic per-token FP8 activations
    ct_w4a16_group128/   compressed-tensors "pack-quantized": INT4 weights packed in int32, group
                         size 128 scales, activations unquantized (W4A16)
    ct_w4a16_channel/    compressed-tensors "pack-quantized" INT4 with one scale per output channel
    ct_w8a16_group128/   compressed-tensors "pack-quantized" INT8 (4 per int32), group size 128 scales
    qwen3_moe_fp8_block/ the Qwen3-MoE fixture (tests/fixtures/models/qwen3_moe, clear routing) with every
                         attention / expert / dense-MLP linear in fp8 128x128 blocks (experts'
                         32-row gate and up parts fuse below a block height); the routers
                         (mlp.gate) stay BF16, listed in modules_to_not_convert
    fp8_no_config/       NO quantization_config, yet F8_E4M3 weights with a per-tensor weight_scale
                         next to each: the checkpoint that used to load silently with its scales
                         ignored
    unknown_tensor/      a plain BF16 checkpoint with one extra tensor no Llama layer has

  Issue 19 part 3 (tests/test_quant_formats.c; each checked against its writer's own dequantization):
    ct_w4a16_asym_{group32,channel}, ct_w8a16_asym_{group32,channel}
                         compressed-tensors pack-quantized with symmetric: false (weight_zero_point)
    ct_w8a8_int8_{token,static}
                         compressed-tensors int-quantized (I8 weights per channel), INT8 activations
                         per token / static (input_scale); refs_w8a8.json
    ct_fp8_static_{tensor,channel}, fp8_static
                         FP8 weights with static per-tensor input scales (compressed-tensors
                         dynamic: false; quant_method fp8 activation_scheme static); refs_w8a8.json
    gptq_w4_g32_sym, gptq_w4_g32_asym_desc_act, gptq_w8_channel_asym, gptq_w8_g32_sym_desc_act
                         GPTQ v1 packed by AutoGPTQ's own QuantLinear.pack (auto-gptq 0.7.1)
    awq_w4_g32           AWQ GEMM packed by AutoAWQ's own WQLinear_GEMM.from_linear (autoawq 0.2.9)
    *_hd64               head_dim-64 variants for tests/gpu/test_cuda_quant_models.c

  KV-cache scales (tests/test_quant_kv.c; refs_kv.json: K / V fake-quantized with the stored scales):
    ct_fp8_kv, ct_fp8_kv_hd64
                         compressed-tensors FP8_DYNAMIC with kv_cache_scheme (static float8 per
                         tensor): self_attn.k_scale / v_scale written by compressed-tensors
    fp8_kv, fp8_kv_legacy
                         quant_method fp8 (128x128 blocks) with F32 scalar self_attn.k_scale /
                         v_scale and "kv_cache_scheme": "static", or the deprecated single
                         self_attn.kv_scale and no declaration
                         (K / V beyond 448 by construction: see KV_SHIFT)
  The GPTQ / AWQ writers need `pip install --no-deps auto-gptq==0.7.1 autoawq==0.2.9` (imported
  through stub packages: their package __init__s want other transformers versions); the tests read
  the committed fixtures and need neither.

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


def make_fp8_block_moe(out):
    """qwen3_moe in fp8 blocks. refs: transformers' fp32 forward of the same checkpoint with the
    exact dequantized weights stored as F32 (per-expert names, as the fixture stores them), and
    the fp8 file loaded by transformers (dequantize=True) must give the same logits up to its
    bf16 dequantization."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "models", "qwen3_moe")
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(out, "config.json"))
    sd = load_file(os.path.join(src, "model.safetensors"))
    tensors, exact = {}, {}
    for k, v in sd.items():
        if is_linear(k):
            q, s = fp8_blocks(v.float())
            tensors[k] = q
            tensors[k[:-len("weight")] + "weight_scale_inv"] = s
            exact[k] = fp8_block_dequant(q, s)
        else:
            tensors[k] = v.contiguous()
            exact[k] = v.float()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    patch_config(out, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                           "weight_block_size": [BLOCK, BLOCK],
                                           "modules_to_not_convert": ["lm_head", "mlp.gate"]})
    plain = out + ".plain"
    shutil.rmtree(plain, ignore_errors=True)
    os.makedirs(plain)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(plain, "config.json"))
    save_file({k: v.contiguous() for k, v in exact.items()}, os.path.join(plain, "model.safetensors"),
              metadata={"format": "pt"})
    ref_model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32,
                                                     attn_implementation="eager").float().eval()
    shutil.rmtree(plain)
    from transformers import FineGrainedFP8Config
    fp8_model = load_dequantized(out, FineGrainedFP8Config(weight_block_size=(BLOCK, BLOCK), dequantize=True))
    ids = torch.randint(4, ref_model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = ref_model(ids).logits.float(), fp8_model(ids).logits.float()
    check_close("qwen3_moe_fp8_block logits (transformers fp8 loader vs exact)", b, a, 2 ** -5)
    write_refs(ref_model, out)


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
            if args.strategy == "tensor":
                s, z = calculate_qparams(w.amin().reshape(1), w.amax().reshape(1), args)
            else:
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


def check_int_packed(bits, group):
    """Checks a pack-quantized weight (symmetric `bits`-bit integers offset by 2^(bits-1), 32 / bits
    per int32, low bits first; one scale per `group` inputs, None = per channel)."""
    def check(k, got, orig, raw):
        base = k[:-len("weight")]
        packed, scale = raw[base + "weight_packed"], raw[base + "weight_scale"].float()
        assert packed.dtype == torch.int32, f"{base}weight_packed: {packed.dtype}"
        per, mask = 32 // bits, (1 << bits) - 1
        u = packed.view(torch.int32).numpy().view("uint32")
        vals = torch.stack([torch.from_numpy(((u >> (bits * i)) & mask).astype("int64")) for i in range(per)], -1)
        q = vals.reshape(packed.shape[0], -1) - (1 << (bits - 1))
        g = group or q.shape[1]
        want = (q.float().reshape(q.shape[0], -1, g) * scale[:, :, None]).reshape(q.shape)
        check_close(k, got, want, 2 ** -8)
        check_close(k + " vs original", got, orig, 2 ** -2 if bits == 4 else 2 ** -6)
        return want
    return check


check_w4_group = check_int_packed(4, 128)


# ---------------------------------------------------------------------------------------------
# Issue 19 part 3: zero points, static activation scales, GPTQ, AWQ.

def check_int_packed_asym(bits, group):
    """Checks an asymmetric pack-quantized weight: values as check_int_packed, zero points in
    weight_zero_point (ceil(rows * bits / 32), groups) int32, packed along the rows (dim 0) with the
    same offset 2^(bits-1); w = (q - z) * scale (compressed-tensors' dequantize)."""
    def check(k, got, orig, raw):
        base = k[:-len("weight")]
        packed, scale = raw[base + "weight_packed"], raw[base + "weight_scale"].float()
        zp = raw[base + "weight_zero_point"]
        assert packed.dtype == torch.int32 and zp.dtype == torch.int32, (packed.dtype, zp.dtype)
        per, mask, off = 32 // bits, (1 << bits) - 1, 1 << (bits - 1)
        u = packed.numpy().view("uint32")
        q = torch.stack([torch.from_numpy(((u >> (bits * i)) & mask).astype("int64")) for i in range(per)], -1)
        q = q.reshape(packed.shape[0], -1) - off
        zu = zp.numpy().view("uint32")  # (rows / per, groups): row r in word r // per, field r % per
        z = torch.stack([torch.from_numpy(((zu >> (bits * i)) & mask).astype("int64")) for i in range(per)], 1)
        z = z.reshape(-1, zp.shape[1])[:q.shape[0]] - off
        assert (z != 0).any(), f"{k}: every zero point is 0, the fixture would not test them"
        g = group or q.shape[1]
        want = ((q.float().reshape(q.shape[0], -1, g) - z.float()[:, :, None]) * scale[:, :, None]).reshape(q.shape)
        check_close(k, got, want, 2 ** -8)
        check_close(k + " vs original", got, orig, 2 ** -2 if bits == 4 else 2 ** -6)
        return want
    return check


def input_amax(model, ids_list):
    """max |x| of each Linear's input over forwards of the prompts (a static-activation observer)."""
    amax, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].float().abs().max().item())
            hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in ids_list:
            model(ids)
    for h in hooks:
        h.remove()
    return amax


def calibration_ids(vocab):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(4, vocab, (1, n), generator=gen) for n in (5, 9)]


def fake_quant_static_fp8(x, s):
    """compressed-tensors' static fp8 activation: clamp(x / s, -448, 448) rounded to e4m3, times s
    (checked equal to compressed-tensors' own fake_quantize on the first call)."""
    y = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    if not getattr(fake_quant_static_fp8, "checked", False):
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
        args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
        ct = fake_quantize(x.float(), torch.tensor([s]), torch.zeros(1, dtype=torch.float8_e4m3fn), args)
        assert torch.equal(ct.float(), y), (ct.float() - y).abs().max()
        fake_quant_static_fp8.checked = True
    return y


def fake_quant_static_int8(x, s):
    """compressed-tensors' static int8 activation: clamp(round(x / s), -128, 127) * s (checked equal
    to compressed-tensors' own fake_quantize on the first call)."""
    y = (x / s).round().clamp(-128, 127) * s
    if not getattr(fake_quant_static_int8, "checked", False):
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
        args = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False)
        ct = fake_quantize(x.float(), torch.tensor([s]), torch.zeros(1, dtype=torch.int8), args)
        assert torch.equal(ct.float(), y), (ct.float() - y).abs().max()
        fake_quant_static_int8.checked = True
    return y


def fake_quant_token_int8(x):
    """Dynamic per-token int8 as vLLM (and atomc's INT8_TOKEN) computes it: s = amax / 127 per token
    (1 when 0), clamp(round(x / s), -127, 127) * s. (compressed-tensors' own observer divides by
    127.5; the checkpoints are served by vLLM's kernels, which use 127.)"""
    s = x.abs().amax(dim=-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (x / s).round().clamp(-127, 127) * s


def write_refs_static(out, model, input_scales, note, quant=None):
    """refs_w8a8.json: write_refs' prompts through `model` (exact fp32 weights) with every quantized
    linear's input fake-quantized with its stored input_scale (the static W8A8 reference; `quant`
    (x, s) defaults to FP8; s None: a dynamic mode that ignores it)."""
    quant = quant or fake_quant_static_fp8
    hooks = []
    for name, m in model.named_modules():
        if name in input_scales:
            s = input_scales[name]
            hooks.append(m.register_forward_pre_hook(lambda mod, args, s=s: (quant(args[0].float(), s),)))
    assert len(hooks) == len(input_scales) > 0
    with open(os.path.join(out, "refs.json")) as f:
        refs = json.load(f)
    prompts = []
    for p in refs["prompts"]:
        ids = torch.tensor([p["ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        seq, greedy, margins = ids, [], []
        with torch.no_grad():
            for _ in range(len(p["greedy"])):
                top2 = torch.topk(model(seq).logits[0, -1].float(), 2)
                greedy.append(int(top2.indices[0]))
                margins.append(round(float(top2.values[0] - top2.values[1]), 6))
                seq = torch.cat([seq, top2.indices[:1].view(1, 1)], dim=1)
        prompts.append(dict(ids=p["ids"], logit_positions=p["logit_positions"],
                            logits=[[round(float(x), 5) for x in logits[i]] for i in p["logit_positions"]],
                            greedy=greedy, greedy_margins=margins))
    for h in hooks:
        h.remove()
    with open(os.path.join(out, "refs_w8a8.json"), "w") as f:
        json.dump(dict(model=os.path.basename(out), generator="tools/make_quant_fixtures.py",
                       reference="transformers fp32 Llama, eager attention, linear weights = the format's exact fp32 "
                                 "dequantization, input activations of every quantized linear fake-quantized " + note,
                       transformers=__import__("transformers").__version__, prompts=prompts), f,
                  separators=(",", ":"))
        f.write("\n")
    return max(abs(x - y) for p, q in zip(prompts, refs["prompts"]) for r, t in zip(p["logits"], q["logits"])
               for x, y in zip(r, t))


def make_ct_fp8_static(out, strategy, seed):
    """compressed-tensors float-quantized FP8 weights (channel / tensor) with static per-tensor FP8
    input activations (dynamic: false): input_scale = max |x| / 448 observed over calibration
    prompts (q / k / v and gate / up see one input, so they get one scale)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import CompressedTensorsConfig

    model = base_model(BASE, seed)
    original = {k: v.float().clone() for k, v in model.state_dict().items()}
    amax = input_amax(model.float(), calibration_ids(BASE["vocab_size"]))
    model = model.to(torch.bfloat16)
    scheme = QuantizationScheme(targets=["Linear"],
                                weights=QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                                                         dynamic=False),
                                input_activations=QuantizationArgs(num_bits=8, type="float", strategy="tensor",
                                                                   symmetric=True, dynamic=False))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    scales = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if not hasattr(m, "weight_scale"):
                continue
            args = m.quantization_scheme.weights
            w = m.weight.float()
            if strategy == "tensor":
                s, _ = calculate_qparams(w.amin().reshape(1), w.amax().reshape(1), args)
            else:
                s, _ = calculate_qparams(w.amin(-1), w.amax(-1), args)
            m.weight_scale.copy_(s.reshape(m.weight_scale.shape))
            # bf16-representable (the checkpoint's dtype), so the stored scale is the one used here
            si = torch.tensor(amax[name] / FP8_MAX).to(torch.bfloat16)
            m.input_scale.copy_(si.reshape(m.input_scale.shape))
            scales[name] = si.float().item()
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(out)
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    raw = load_file(os.path.join(out, "model.safetensors"))
    for name, s in scales.items():
        assert raw[name + ".input_scale"].float().item() == s, name
    model = load_dequantized(out, CompressedTensorsConfig(dequantize=True))
    got = dict(model.state_dict())
    exact = {k: check_fp8_channel(k, got[k], original[k], raw) for k in original if is_linear(k)}
    refs_from_exact(model, exact, out)
    d = write_refs_static(out, model, scales, "with its stored input_scale: e4m3(clamp(x / s, -448, 448)) * s "
                                              "(compressed-tensors' fake_quantize for static fp8 tensor activations)")
    print(f"  {os.path.basename(out)}: static W8A8 vs weight-only logits differ by {d:.4f}")


def check_int8_channel(k, got, orig, raw):
    base = k[:-len("weight")]
    assert raw[k].dtype == torch.int8, f"{k}: {raw[k].dtype}"
    want = raw[k].float() * raw[base + "weight_scale"].float()
    check_close(k, got, want, 2 ** -8)
    check_close(k + " vs original", got, orig, 2 ** -6)
    return want


def make_ct_int8(out, static, seed, base=BASE):
    """compressed-tensors int-quantized (llm-compressor's W8A8 INT8): int8 weights per channel
    (symmetric, min-max), INT8 input activations dynamic per token, or static per tensor with
    input_scale = max |x| / 127.5 (compressed-tensors' symmetric observer: (q_max - q_min) / 2)
    over the calibration prompts."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import CompressedTensorsConfig

    model = base_model(base, seed)
    original = {k: v.float().clone() for k, v in model.state_dict().items()}
    amax = input_amax(model.float(), calibration_ids(base["vocab_size"]))
    model = model.to(torch.bfloat16)
    act = QuantizationArgs(num_bits=8, type="int", strategy="tensor" if static else "token", symmetric=True,
                           dynamic=not static)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", strategy="channel",
                                                                             symmetric=True, dynamic=False),
                                input_activations=act)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    scales = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if not hasattr(m, "weight_scale"):
                continue
            w = m.weight.float()
            sc, _ = calculate_qparams(w.amin(-1), w.amax(-1), m.quantization_scheme.weights)
            m.weight_scale.copy_(sc.reshape(m.weight_scale.shape))
            if static:
                si = torch.tensor(amax[name] / 127.5).to(torch.bfloat16)
                m.input_scale.copy_(si.reshape(m.input_scale.shape))
                scales[name] = si.float().item()
            else:
                scales[name] = None
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(out)
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    raw = load_file(os.path.join(out, "model.safetensors"))
    model = load_dequantized(out, CompressedTensorsConfig(dequantize=True))
    got = dict(model.state_dict())
    exact = {k: check_int8_channel(k, got[k], original[k], raw) for k in original if is_linear(k)}
    refs_from_exact(model, exact, out)
    if static:
        d = write_refs_static(out, model, scales, "with its stored input_scale: clamp(round(x / s), -128, 127) * s "
                                                  "(compressed-tensors' fake_quantize for static int8 tensor "
                                                  "activations)", fake_quant_static_int8)
    else:
        d = write_refs_static(out, model, scales, "per token as vLLM's int8 W8A8: s = amax / 127, "
                                                  "clamp(round(x / s), -127, 127) * s",
                              lambda x, s: fake_quant_token_int8(x))
    print(f"  {os.path.basename(out)}: W8A8 vs weight-only logits differ by {d:.4f}")


def make_fp8_static(out, base=BASE):
    """quant_method fp8 (vLLM's Fp8Config) with per-tensor weights: F8_E4M3 weight, F32 scalar
    weight_scale and input_scale per linear, activation_scheme static. Written tensor by tensor
    (transformers has no loader for per-tensor fp8); the refs use the format's definition
    (weight * weight_scale; activations e4m3(clamp(x / input_scale)) * input_scale)."""
    model = base_model(base, 9).float()
    amax = input_amax(model, calibration_ids(base["vocab_size"]))
    model = model.to(torch.bfloat16)
    save_plain(model, out)
    tensors, exact, scales = {}, {}, {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and base.get("tie_word_embeddings"):
            continue
        v = v.contiguous()
        if is_linear(k):
            mod = k[:-len(".weight")]
            s = v.float().abs().max() / FP8_MAX
            q = (v.float() / s).to(torch.float8_e4m3fn)
            tensors[k] = q
            tensors[mod + ".weight_scale"] = s.reshape(()).float()
            si = torch.tensor(amax[mod] / FP8_MAX, dtype=torch.float32)
            tensors[mod + ".input_scale"] = si.reshape(())
            scales[mod] = si.item()
            exact[k] = q.float() * s
        else:
            tensors[k] = v
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    patch_config(out, quantization_config={"activation_scheme": "static", "fmt": "e4m3", "quant_method": "fp8",
                                           "modules_to_not_convert": ["lm_head"]})
    plain = fresh_ref_model(out, {**{k: v for k, v in tensors.items() if not is_linear(k)}, **exact})
    write_refs(plain, out)
    d = write_refs_static(out, plain, scales, "with its stored input_scale: e4m3(clamp(x / s, -448, 448)) * s "
                                              "(vLLM's Fp8Config static scheme, per-tensor)")
    print(f"  fp8_static: static W8A8 vs weight-only logits differ by {d:.4f}")


def fresh_ref_model(out, tensors):
    """An fp32 eager transformers model of out/config.json holding `tensors` (the non-linear ones as
    stored, the linears' exact dequantization): built fresh, so its rotary inv_freq is fp32 (a
    model cast to bf16 and back keeps a bf16-rounded inv_freq)."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(out)
    cfg.pop("quantization_config", None) if isinstance(cfg, dict) else None
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).float().eval()
    sd = model.state_dict()
    with torch.no_grad():
        for k in sd:
            if k in tensors:
                sd[k].copy_(tensors[k].float())
            else:
                assert k.endswith("inv_freq") or k == "lm_head.weight" and cfg.tie_word_embeddings, k
    return model


def _import_stub(pkg, subpackages):
    """Imports modules of `pkg` without running its package __init__ (AutoGPTQ's and AutoAWQ's import
    their model zoos, which need other transformers versions): stub packages with the real paths."""
    import importlib.util
    import sys
    import types
    if pkg in sys.modules:
        return
    spec = importlib.util.find_spec(pkg)
    if spec is None:
        raise SystemExit(f"{pkg} is not installed: pip install --no-deps {dict(auto_gptq='auto-gptq==0.7.1', awq='autoawq==0.2.9')[pkg]}")
    base = os.path.dirname(spec.origin)
    for sub in [""] + subpackages:
        name = pkg + ("." + sub if sub else "")
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(base, *sub.split("."))] if sub else [base]
        sys.modules.setdefault(name, m)


# Modules that share an input (so GPTQ's act-order permutation, from that input's Hessian, is theirs in common).
SHARED_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
                "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}


def int_qparams(w, bits, group_cols, sym, zero_min):
    """GPTQ / AWQ-style min-max scales and zeros of w (out, cols) over one group's columns: scale =
    (max - min) / maxq (range including 0), zero = round(-min / scale) clamped to [zero_min, maxq];
    symmetric: range +-max |w|, zero (maxq + 1) / 2. Scales are rounded to fp16 (the stored dtype)."""
    maxq = 2 ** bits - 1
    wg = w[:, group_cols]
    xmin, xmax = wg.min(1).values.clamp(max=0), wg.max(1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    scale = ((xmax - xmin) / maxq).clamp(min=1e-8).half().float()
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else (-xmin / scale).round().clamp(zero_min, maxq)
    return scale, zero


def make_gptq(out, bits, group, sym, desc_act, seed, base=BASE):
    """GPTQ (AutoGPTQ's v1 checkpoint format, "zero - 1" stored in qzeros): scales / zeros per
    group by min-max, the weights fake-quantized with them, then packed by AutoGPTQ's own
    QuantLinear.pack (auto_gptq 0.7.1, nn_modules/qlinear/qlinear_cuda.py). desc_act: a random
    act-order permutation per shared input, g_idx[perm[i]] = i // group as GPTQ writes it. The
    reference: AutoGPTQ's torch dequantization (the same module's forward, fp16) checked against
    the exact fp32 dequantization (q - (qzero + 1)) * scale[g_idx] read back from the file, which
    gives refs.json."""
    _import_stub("auto_gptq", ["nn_modules", "nn_modules.qlinear"])
    from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear
    model = base_model(base, seed).float()
    save_plain(model.to(torch.bfloat16), out)
    sd = {k: v.contiguous() for k, v in model.float().state_dict().items()}
    maxq = 2 ** bits - 1
    gen = torch.Generator().manual_seed(seed)
    perms = {}
    tensors, exact = {}, {}
    for k, w in sd.items():
        if k == "lm_head.weight" and base.get("tie_word_embeddings"):
            continue
        if not is_linear(k):
            tensors[k] = w.to(torch.bfloat16)
            continue
        mod = k[:-len(".weight")]
        rows, cols = w.shape
        gs = group if group > 0 else cols
        ngroups = -(-cols // gs)
        if desc_act:
            key = SHARED_INPUT[mod.split(".")[-1]]
            perm = perms.setdefault(key, torch.randperm(cols, generator=gen))
            g_idx = torch.empty(cols, dtype=torch.int32)
            g_idx[perm] = (torch.arange(cols) // gs).to(torch.int32)
        else:
            g_idx = (torch.arange(cols) // gs).to(torch.int32)
        scale, zero = torch.zeros(rows, ngroups), torch.zeros(rows, ngroups)
        for g in range(ngroups):
            # v1 stores zero - 1 in unsigned fields: a zero of 0 cannot be written, so zeros start at 1
            scale[:, g], zero[:, g] = int_qparams(w, bits, g_idx == g, sym, 1)
        s_c, z_c = scale[:, g_idx.long()], zero[:, g_idx.long()]
        wq = ((w / s_c).round() + z_c).clamp(0, maxq)
        wfq = (wq - z_c) * s_c
        lin = torch.nn.Linear(cols, rows, bias=False)
        lin.weight.data = wfq.clone()
        ql = QuantLinear(bits, group, cols, rows, False, weight_dtype=torch.float16)
        ql.pack(lin, scale, zero, g_idx)
        qweight, qzeros = ql.qweight.contiguous(), ql.qzeros.contiguous()
        tensors[mod + ".qweight"], tensors[mod + ".qzeros"] = qweight, qzeros
        tensors[mod + ".scales"] = ql.scales.to(torch.float16).contiguous()
        tensors[mod + ".g_idx"] = ql.g_idx.to(torch.int32).contiguous()
        # exact fp32 dequantization from the packed tensors (the format's definition)
        per = 32 // bits
        qu = qweight.numpy().view("uint32")
        vals = torch.stack([torch.from_numpy(((qu >> (bits * i)) & maxq).astype("int64")) for i in range(per)], 1)
        vals = vals.reshape(cols, rows)  # (cols, rows): word kw holds columns kw*per + i
        zu = qzeros.numpy().view("uint32")
        zs = torch.stack([torch.from_numpy(((zu >> (bits * i)) & maxq).astype("int64")) for i in range(per)], -1)
        zs = zs.reshape(ngroups, rows) + 1
        sc = tensors[mod + ".scales"].float()
        gi = tensors[mod + ".g_idx"].long()
        want = ((vals.float() - zs[gi].float()) * sc[gi]).t().contiguous()
        assert torch.equal(vals.t(), wq.long()), f"{mod}: AutoGPTQ packed other integers than the quantizer's"
        check_close(mod + " exact vs fake-quant", want, wfq, 1e-6)
        with torch.no_grad():  # AutoGPTQ's own torch dequantization (fp16)
            ref = ql.half()(torch.eye(cols, dtype=torch.float16)).float().t()
        check_close(mod + " AutoGPTQ dequant vs exact", ref, want, 2 ** -9)
        check_close(mod + " vs original", want, w, 2 ** -2 if bits == 4 else 2 ** -6)
        exact[k] = want
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    patch_config(out, quantization_config={"quant_method": "gptq", "bits": bits, "group_size": group,
                                           "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq",
                                           "true_sequential": True, "damp_percent": 0.01, "static_groups": False})
    write_refs(fresh_ref_model(out, {**{k: v for k, v in tensors.items() if k in sd}, **exact}), out)


def make_awq(out, group, seed, base=BASE):
    """AWQ GEMM (AutoAWQ's format: qweight (in, out / 8), nibble order 0 2 4 6 1 3 5 7, qzeros the
    same, fp16 scales (groups, out)), packed by AutoAWQ's own WQLinear_GEMM.from_linear (autoawq 0.2.9)
    from min-max scales / zeros; the reference: AutoAWQ's dequantize_gemm (fp16) checked against the
    exact fp32 (q - z) * scale read back from the file, which gives refs.json."""
    _import_stub("awq", ["modules", "modules.linear", "utils"])
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm
    model = base_model(base, seed).float()
    save_plain(model.to(torch.bfloat16), out)
    sd = {k: v.contiguous() for k, v in model.float().state_dict().items()}
    tensors, exact = {}, {}
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    for k, w in sd.items():
        if k == "lm_head.weight" and base.get("tie_word_embeddings"):
            continue
        if not is_linear(k):
            tensors[k] = w.to(torch.bfloat16)
            continue
        mod = k[:-len(".weight")]
        rows, cols = w.shape
        ngroups = cols // group
        scale, zero = torch.zeros(ngroups, rows), torch.zeros(ngroups, rows)
        for g in range(ngroups):
            cols_g = torch.zeros(cols, dtype=torch.bool)
            cols_g[g * group:(g + 1) * group] = True
            s, z = int_qparams(w, 4, cols_g, False, 0)
            scale[g], zero[g] = s, z
        s_c, z_c = scale.t().repeat_interleave(group, 1), zero.t().repeat_interleave(group, 1)
        wq = ((w / s_c).round() + z_c).clamp(0, 15)
        wfq = (wq - z_c) * s_c
        lin = torch.nn.Linear(cols, rows, bias=False)
        lin.weight.data = wfq.clone()
        ql = WQLinear_GEMM.from_linear(lin, 4, group, scales=scale.half(), zeros=zero.to(torch.int32))
        qweight, qzeros, scales = ql.qweight.contiguous(), ql.qzeros.contiguous(), ql.scales.contiguous()
        tensors[mod + ".qweight"], tensors[mod + ".qzeros"], tensors[mod + ".scales"] = qweight, qzeros, scales
        qu = qweight.numpy().view("uint32")  # (cols, rows / 8)
        nib = torch.stack([torch.from_numpy(((qu >> (4 * i)) & 15).astype("int64")) for i in range(8)], -1)
        vals = torch.empty(cols, rows, dtype=torch.int64)
        zu = qzeros.numpy().view("uint32")
        znib = torch.stack([torch.from_numpy(((zu >> (4 * i)) & 15).astype("int64")) for i in range(8)], -1)
        zs = torch.empty(ngroups, rows, dtype=torch.int64)
        for i in range(8):
            vals[:, order[i]::8] = nib[:, :, i]
            zs[:, order[i]::8] = znib[:, :, i]
        assert torch.equal(vals.t(), wq.long()) and torch.equal(zs, zero.long()), f"{mod}: AWQ packing"
        want = ((vals.float() - zs.float().repeat_interleave(group, 0)) *
                scales.float().repeat_interleave(group, 0)).t().contiguous()
        check_close(mod + " exact vs fake-quant", want, wfq, 1e-6)
        ref = dequantize_gemm(qweight, qzeros, scales, 4, group).float().t()
        check_close(mod + " AutoAWQ dequantize_gemm vs exact", ref, want, 2 ** -9)
        check_close(mod + " vs original", want, w, 2 ** -2)
        exact[k] = want
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    patch_config(out, quantization_config={"quant_method": "awq", "bits": 4, "group_size": group,
                                           "zero_point": True, "version": "gemm", "modules_to_not_convert": None})
    write_refs(fresh_ref_model(out, {**{k: v for k, v in tensors.items() if k in sd}, **exact}), out)


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


# ---------------------------------------------------------------------------------------------
# KV-cache scales (issue 19 item: kv_cache_scheme / k_scale / v_scale)

# The KV fixtures scale q_proj by 2^-8 and k_proj by 2^8 (q.k unchanged), v_proj by 2^8 and o_proj
# by 2^-8 (o_proj(v) unchanged): the model computes the same function, but its post-RoPE K and its
# V reach |x| > 448, so an FP8 KV cache that ignored the stored scales (1.0) would saturate them
# and the test against refs_kv.json would fail.
KV_SHIFT = 2.0 ** 8


def kv_rescale(model):
    with torch.no_grad():
        for ly in model.model.layers:
            a = ly.self_attn
            a.q_proj.weight.mul_(1 / KV_SHIFT)
            a.k_proj.weight.mul_(KV_SHIFT)
            a.v_proj.weight.mul_(KV_SHIFT)
            a.o_proj.weight.mul_(1 / KV_SHIFT)
    return model


def fake_quant_kv(x, s):
    """compressed-tensors' static fp8 tensor fake-quantization, e4m3(clamp(x / s, +-448)) * s."""
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s


_KV_HOOK = {}


def _kv_attention(module, query, key, value, attention_mask, **kw):
    """An eager attention (transformers' own) whose post-RoPE K / V pass through _KV_HOOK["fn"]
    (layer, "k" | "v", tensor) -> tensor first: the KV observer and the fake-quantized KV cache."""
    from transformers.models.llama.modeling_llama import eager_attention_forward
    fn = _KV_HOOK.get("fn")
    if fn:
        key = fn(module.layer_idx, "k", key)
        value = fn(module.layer_idx, "v", value)
    return eager_attention_forward(module, query, key, value, attention_mask, **kw)


def _register_kv_attention():
    """"atomc_kv": _kv_attention with eager's additive causal mask (a registered attention gets a
    boolean sdpa-style mask otherwise, which eager_attention_forward would add as 0 / 1)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register("atomc_kv", _kv_attention)
    AttentionMaskInterface.register("atomc_kv", eager_mask)


def kv_amax(model, ids_list):
    """max |K| and |V| (post-RoPE, what the cache holds) per layer over forwards of the prompts:
    llm-compressor's static KV observer (its hooks see the key / value states the cache stores)."""
    _register_kv_attention()
    amax = {}

    def obs(layer, which, x):
        amax[(layer, which)] = max(amax.get((layer, which), 0.0), x.float().abs().max().item())
        return x
    model.set_attn_implementation("atomc_kv")
    _KV_HOOK["fn"] = obs
    with torch.no_grad():
        for ids in ids_list:
            model(ids)
    _KV_HOOK.pop("fn")
    model.set_attn_implementation("eager")
    return amax


def write_refs_kv(out, model, kscale, vscale, note):
    """refs_kv.json: refs.json's prompts through `model` (fp32, the exact dequantized weights, the
    activations unquantized) with every layer's post-RoPE K and V fake-quantized with its stored
    k_scale / v_scale. Returns max |logit - refs.json's|."""
    _register_kv_attention()
    model.set_attn_implementation("atomc_kv")
    _KV_HOOK["fn"] = lambda l, w, x: fake_quant_kv(x.float(), (kscale if w == "k" else vscale)[l])
    with open(os.path.join(out, "refs.json")) as f:
        refs = json.load(f)
    prompts = []
    for p in refs["prompts"]:
        ids = torch.tensor([p["ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        seq, greedy, margins = ids, [], []
        with torch.no_grad():
            for _ in range(len(p["greedy"])):
                top2 = torch.topk(model(seq).logits[0, -1].float(), 2)
                greedy.append(int(top2.indices[0]))
                margins.append(round(float(top2.values[0] - top2.values[1]), 6))
                seq = torch.cat([seq, top2.indices[:1].view(1, 1)], dim=1)
        prompts.append(dict(ids=p["ids"], logit_positions=p["logit_positions"],
                            logits=[[round(float(x), 5) for x in logits[i]] for i in p["logit_positions"]],
                            greedy=greedy, greedy_margins=margins))
    _KV_HOOK.pop("fn")
    model.set_attn_implementation("eager")
    with open(os.path.join(out, "refs_kv.json"), "w") as f:
        json.dump(dict(model=os.path.basename(out), generator="tools/make_quant_fixtures.py",
                       reference="transformers fp32 Llama, eager attention, linear weights = the format's exact fp32 "
                                 "dequantization, activations unquantized, post-RoPE K and V of every layer "
                                 "fake-quantized " + note,
                       k_scale=[kscale[l] for l in sorted(kscale)], v_scale=[vscale[l] for l in sorted(vscale)],
                       transformers=__import__("transformers").__version__, prompts=prompts), f,
                  separators=(",", ":"))
        f.write("\n")
    return max(abs(x - y) for p, q in zip(prompts, refs["prompts"]) for r, t in zip(p["logits"], q["logits"])
               for x, y in zip(r, t))


class _CtAttentionPatch:
    """While active, compressed-tensors takes transformers 5's LlamaAttention (forward(..., cache))
    for the cached attention module it is (it checks for a past_key_value(s) argument)."""

    def __enter__(self):
        import sys
        self.saved = []
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "is_cached_attention_module", None) if name.startswith("compressed_tensors") else None
            if f is not None:
                self.saved.append((mod, f))
                setattr(mod, "is_cached_attention_module",
                        lambda m, f=f: type(m).__name__ == "LlamaAttention" or f(m))

    def __exit__(self, *exc):
        for mod, f in self.saved:
            mod.is_cached_attention_module = f


def make_ct_fp8_kv(out, seed, base=BASE):
    """compressed-tensors FP8_DYNAMIC (FP8 weights per channel, dynamic per-token FP8 activations)
    with kv_cache_scheme {num_bits 8, float, tensor, static}: per layer self_attn.k_scale /
    v_scale = max |K| / 448, max |V| / 448 over calibration prompts, written by compressed-tensors
    (apply_quantization_config registers them, ModelCompressor writes them and the config).
    transformers 5.x + compressed-tensors 0.20 do not apply the KV scheme (compressed-tensors looks
    for an attention forward taking past_key_value(s); transformers 5 names it `cache`), so its
    dequantize=True load drops the scales (checked: its logits equal the weight-only refs); the KV
    reference (refs_kv.json) fake-quantizes K / V in torch with the stored scales instead."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import CompressedTensorsConfig

    model = kv_rescale(base_model(base, seed))
    original = {k: v.float().clone() for k, v in model.state_dict().items()}
    amax = kv_amax(fresh_model_like(model), calibration_ids(base["vocab_size"]))
    scheme = QuantizationScheme(targets=["Linear"],
                                weights=QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True,
                                                         dynamic=False),
                                input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token",
                                                                   symmetric=True, dynamic=True))
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    patch = _CtAttentionPatch()
    with patch:
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                            kv_cache_scheme=kv))
    kscale, vscale = {}, {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if hasattr(m, "weight_scale"):
                w = m.weight.float()
                s, _ = calculate_qparams(w.amin(-1), w.amax(-1), m.quantization_scheme.weights)
                m.weight_scale.copy_(s.reshape(m.weight_scale.shape))
            if hasattr(m, "k_scale"):
                l = m.layer_idx
                for which, dst, param in (("k", kscale, m.k_scale), ("v", vscale, m.v_scale)):
                    # bf16-representable (the dtype compressed-tensors gives the scale)
                    si = torch.tensor(amax[(l, which)] / FP8_MAX).to(param.dtype)
                    param.copy_(si.reshape(param.shape))
                    dst[l] = si.float().item()
    assert kscale and max(amax.values()) > FP8_MAX, amax  # K / V really exceed the fp8 range
    with patch:
        compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    assert compressor.quantization_config.kv_cache_scheme is not None
    # The forced format would also "compress" the attention modules, which hold no weight: their
    # schemes are set aside while the linears are compressed (their k_scale / v_scale stay).
    attn = [m for m in model.modules() if hasattr(m, "k_scale")]
    schemes = [m.__dict__.pop("quantization_scheme") for m in attn]
    compressor.compress_model(model)
    for m, sc in zip(attn, schemes):
        m.quantization_scheme = sc
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(out)
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    raw = load_file(os.path.join(out, "model.safetensors"))
    for l in kscale:
        assert raw[f"model.layers.{l}.self_attn.k_scale"].float().item() == kscale[l]
        assert raw[f"model.layers.{l}.self_attn.v_scale"].float().item() == vscale[l]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    model = load_dequantized(out, CompressedTensorsConfig(dequantize=True))
    got = dict(model.state_dict())
    assert not any(k.endswith(("k_scale", "v_scale")) for k in got), "transformers now keeps the KV scales"
    exact = {k: check_fp8_channel(k, got[k], original[k], raw) for k in original if is_linear(k)}
    refs_from_exact(model, exact, out)
    d = write_refs_kv(out, model, kscale, vscale, "with its stored self_attn.k_scale / v_scale: "
                                                  "e4m3(clamp(x / s, -448, 448)) * s")
    print(f"  {os.path.basename(out)}: fp8 KV vs unquantized KV logits differ by {d:.4f}")


def fresh_model_like(model):
    """An fp32 copy of `model` with fp32 rotary frequencies (for observers)."""
    ref = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager", dtype=torch.float32).eval()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=False)
    return ref


def make_fp8_kv(out, legacy=False):
    """quant_method fp8 (vLLM's Fp8Config), 128x128-block weights, with F32 scalar
    self_attn.k_scale / v_scale per layer and "kv_cache_scheme": "static" (the AutoFP8 / AMD FP8-KV
    layout; legacy: the deprecated single self_attn.kv_scale = max of both, which vLLM uses for K
    and V, and no kv_cache_scheme key). Written tensor by tensor (as
    make_fp8_block); transformers' FineGrainedFP8 loader has no KV scales, so refs_kv.json
    fake-quantizes K / V in torch."""
    model = kv_rescale(base_model(dict(BASE, intermediate_size=256), 11))
    amax = kv_amax(fresh_model_like(model), calibration_ids(BASE["vocab_size"]))
    save_plain(model, out)
    tensors, exact = {}, {}
    for k, v in model.state_dict().items():
        v = v.contiguous()
        if is_linear(k):
            q, s = fp8_blocks(v.float())
            tensors[k] = q
            tensors[k[:-len("weight")] + "weight_scale_inv"] = s
            exact[k] = fp8_block_dequant(q, s)
        else:
            tensors[k] = v
    kscale, vscale = {}, {}
    for l in range(BASE["num_hidden_layers"]):
        ks = torch.tensor(amax[(l, "k")] / FP8_MAX, dtype=torch.float32)
        vs = torch.tensor(amax[(l, "v")] / FP8_MAX, dtype=torch.float32)
        if legacy:
            ks = vs = torch.maximum(ks, vs)
            tensors[f"model.layers.{l}.self_attn.kv_scale"] = ks.reshape(())
        else:
            tensors[f"model.layers.{l}.self_attn.k_scale"] = ks.reshape(())
            tensors[f"model.layers.{l}.self_attn.v_scale"] = vs.reshape(())
        kscale[l], vscale[l] = ks.item(), vs.item()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
          "modules_to_not_convert": ["lm_head"]}
    if not legacy:  # AutoFP8 / AMD / Tencent FP8 checkpoints declare their calibrated KV scales so
        qc["kv_cache_scheme"] = "static"
    patch_config(out, quantization_config=qc)
    plain = fresh_ref_model(out, {**{k: v for k, v in tensors.items() if not is_linear(k) and "_scale" not in k},
                                  **exact})
    write_refs(plain, out)
    d = write_refs_kv(out, plain, kscale, vscale, "with its stored self_attn." +
                      ("kv_scale (for K and V)" if legacy else "k_scale / v_scale") + ": e4m3(clamp(x / s, -448, 448)) * s")
    print(f"  {os.path.basename(out)}: fp8 KV vs unquantized KV logits differ by {d:.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant"))
    ap.add_argument("--only", action="append", help="write only this fixture (repeatable)")
    a = ap.parse_args()
    jobs = {
        "fp8_block": make_fp8_block,
        "ct_fp8_channel": lambda o: make_ct(
            o, BASE, dict(weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False),
                          input_activations=dict(num_bits=8, type="float", strategy="token", symmetric=True,
                                                 dynamic=True)),
            "float-quantized", 2, check_fp8_channel),
        "ct_fp8_tensor": lambda o: make_ct(
            o, BASE, dict(weights=dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False),
                          input_activations=dict(num_bits=8, type="float", strategy="token", symmetric=True,
                                                 dynamic=True)),
            "float-quantized", 6, check_fp8_channel),
        "ct_w4a16_group128": lambda o: make_ct(
            o, BASE_128, dict(weights=dict(num_bits=4, type="int", strategy="group", group_size=128, symmetric=True,
                                           dynamic=False)),
            "pack-quantized", 3, check_w4_group),
        "qwen3_moe_fp8_block": make_fp8_block_moe,
        "ct_w4a16_channel": lambda o: make_ct(
            o, BASE, dict(weights=dict(num_bits=4, type="int", strategy="channel", symmetric=True, dynamic=False)),
            "pack-quantized", 7, check_int_packed(4, None)),
        "ct_w8a16_group128": lambda o: make_ct(
            o, BASE_128, dict(weights=dict(num_bits=8, type="int", strategy="group", group_size=128, symmetric=True,
                                           dynamic=False)),
            "pack-quantized", 8, check_int_packed(8, 128)),
        "ct_w4a16_asym_group32": lambda o: make_ct(
            o, BASE, dict(weights=dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False,
                                       dynamic=False)),
            "pack-quantized", 21, check_int_packed_asym(4, 32)),
        "ct_w8a16_asym_channel": lambda o: make_ct(
            o, BASE, dict(weights=dict(num_bits=8, type="int", strategy="channel", symmetric=False, dynamic=False)),
            "pack-quantized", 22, check_int_packed_asym(8, None)),
        "ct_w4a16_asym_channel": lambda o: make_ct(
            o, BASE, dict(weights=dict(num_bits=4, type="int", strategy="channel", symmetric=False, dynamic=False)),
            "pack-quantized", 23, check_int_packed_asym(4, None)),
        "ct_w8a16_asym_group32": lambda o: make_ct(
            o, BASE, dict(weights=dict(num_bits=8, type="int", strategy="group", group_size=32, symmetric=False,
                                       dynamic=False)),
            "pack-quantized", 24, check_int_packed_asym(8, 32)),
        "ct_fp8_static_tensor": lambda o: make_ct_fp8_static(o, "tensor", 25),
        "ct_fp8_static_channel": lambda o: make_ct_fp8_static(o, "channel", 26),
        "fp8_static": make_fp8_static,
        "ct_w8a8_int8_token": lambda o: make_ct_int8(o, False, 27),
        "ct_w8a8_int8_static": lambda o: make_ct_int8(o, True, 28),
        "gptq_w4_g32_sym": lambda o: make_gptq(o, 4, 32, True, False, 31),
        "gptq_w4_g32_asym_desc_act": lambda o: make_gptq(o, 4, 32, False, True, 32),
        "gptq_w8_channel_asym": lambda o: make_gptq(o, 8, -1, False, False, 33),
        "gptq_w8_g32_sym_desc_act": lambda o: make_gptq(o, 8, 32, True, True, 34),
        "awq_w4_g32": lambda o: make_awq(o, 32, 35),
        # head_dim 64 (BASE_128), for the CUDA model tests (tests/gpu/test_cuda_quant_models.c)
        "gptq_w4_g64_asym_desc_act_hd64": lambda o: make_gptq(o, 4, 64, False, True, 36, BASE_128),
        "awq_w4_g64_hd64": lambda o: make_awq(o, 64, 37, BASE_128),
        "fp8_static_hd64": lambda o: make_fp8_static(o, BASE_128),
        "ct_w8a8_int8_static_hd64": lambda o: make_ct_int8(o, True, 38, BASE_128),
        "ct_fp8_kv": lambda o: make_ct_fp8_kv(o, 41),
        "ct_fp8_kv_hd64": lambda o: make_ct_fp8_kv(o, 42, BASE_128),
        "fp8_kv": make_fp8_kv,
        "fp8_kv_legacy": lambda o: make_fp8_kv(o, legacy=True),
        "fp8_no_config": make_fp8_no_config,
        "unknown_tensor": make_unknown_tensor,
    }
    for name, fn in jobs.items():
        if a.only and name not in a.only:
            continue
        out = os.path.join(a.out, name)
        shutil.rmtree(out, ignore_errors=True)
        fn(out)
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        print(f"{name}: {size / 1024:.1f} KB ({', '.join(sorted(os.listdir(out)))})")


if __name__ == "__main__":
    main()
