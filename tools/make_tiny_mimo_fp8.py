#!/usr/bin/env python3
"""Writes tests/fixtures/quant/mimo_v2_flash_fp8: a tiny random MiMo-V2-Flash
(MiMoV2FlashForCausalLM) as XiaomiMiMo/MiMo-V2-Flash ships on the hub: FP8 weights and the
release's own config.json format.

Model: the real head dims (q/k 192, v 128), hidden 64, 4 heads, 2 layers full / sliding (window
9: sliding_window_size 8 previous tokens plus the query, crossed by the 19- and 37-token prompts),
the sliding layer with 4 KV heads and per-head sinks, the full one 2, partial rotary 0.334 (64
dims) with theta 1e6 (full) / 1e4 (sliding), attention_value_scale 0.707, layer 0 a dense MLP,
layer 1 4 experts top-2 with sigmoid routing, a correction bias and routed_scaling_factor 1.5. The
routing channel of tools/make_tiny_glm_mimo.py keeps expert selection clear of ties.

Weights: quant_method "fp8", fmt e4m3, activation_scheme dynamic, weight_block_size [128, 128]:
every linear of the decoder layers (q / k / v / o projections, the dense MLP, every expert's
gate / up / down) stored F8_E4M3 with an F32 weight_scale_inv per 128x128 block (rows in whole
blocks or one partial block: see main); the routers (F32),
their F32 correction bias, the sinks, norms, embeddings and lm_head (BF16) as stored;
modules_to_not_convert lists lm_head.

config.json: the release's keys, not transformers' MiMoV2FlashConfig ones: hybrid_layer_pattern
(0 full, 1 sliding), moe_layer_freq (0 dense, 1 MoE), rope_theta / swa_rope_theta /
partial_rotary_factor, swa_num_attention_heads / swa_num_key_value_heads / swa_head_dim /
swa_v_head_dim, sliding_window and sliding_window_size, add_swa_attention_sink_bias /
add_full_attention_sink_bias, layernorm_epsilon, scoring_func / topk_method, null
routed_scaling_factor and n_shared_experts where the release has them (here routed_scaling_factor
is 1.5 so that it matters). The installed transformers (5.x) reads few of them, so the references
come from the same model built with the equivalent MiMoV2FlashConfig (layer_types, mlp_layer_types,
rope_parameters per layer type, sliding_window 9).

refs.json: transformers' fp32 forward (eager attention) with every quantized weight set to the
format's exact fp32 dequantization (fp8 value x block scale): what atomc's weight-only CPU run
computes. The checkpoint as transformers' own fp8 loader reads it (FineGrainedFP8Config,
dequantize=True, with the equivalent config) is checked to give the same logits up to its bf16
dequantization, which proves the file is in the format transformers reads. Prompts of 1, 6, 19
and 37 tokens, 16 greedy tokens each with their margins.
refs_w8a8.json: the same forward with the input activations of every FP8 linear fake-quantized as
quant_method fp8 with dynamic activations states (e4m3, one scale per token and 128-column group;
tools/make_w8a8_refs.py's rounding), the experts per gathered token rows and on their SiLU x up
output: what atomc computes by default (and the CUDA backend's FP8 kernels).

Run (CPU, ~20 s):  python3 tools/make_tiny_mimo_fp8.py [--out tests/fixtures/quant]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, MiMoV2FlashConfig, MiMoV2FlashForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_quant_fixtures import BLOCK, check_close, fp8_block_dequant, fp8_blocks  # noqa: E402
from make_tiny_glm_mimo import MIN_KEY_GAP, add_routing_channel, gap_hooks, moe_gates  # noqa: E402
from make_tiny_models import BASE, init_weights, references  # noqa: E402
from make_w8a8_refs import experts_forward_w8a8, fake_quant_fp8  # noqa: E402

NAME = "mimo_v2_flash_fp8"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NOT_CONVERTED = ["lm_head"]
PATTERN = [0, 1]         # hybrid_layer_pattern: full / sliding
MOE_FREQ = [0, 1]        # moe_layer_freq: dense / MoE
WINDOW_SIZE = 8          # sliding_window_size: previous tokens (window 9 with the query)
THETA, SWA_THETA, PARTIAL = 1000000.0, 10000.0, 0.334

MODEL = dict(num_hidden_layers=2, num_attention_heads=4, head_dim=192, v_head_dim=128, num_key_value_heads=2,
             intermediate_size=64, attention_value_scale=0.707, n_routed_experts=4, num_experts_per_tok=2,
             n_group=1, topk_group=1, moe_intermediate_size=16, routed_scaling_factor=1.5, norm_topk_prob=True,
             bos_token_id=None, eos_token_id=3)


def hf_config():
    """The release config's meaning as transformers' MiMoV2FlashConfig spells it."""
    kw = dict(BASE)
    kw.update(MODEL)
    kw.update(layer_types=["sliding_attention" if p else "full_attention" for p in PATTERN],
              mlp_layer_types=["sparse" if f else "dense" for f in MOE_FREQ], sliding_window=WINDOW_SIZE + 1,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": THETA,
                                                  "partial_rotary_factor": PARTIAL},
                               "sliding_attention": {"rope_type": "default", "rope_theta": SWA_THETA,
                                                     "partial_rotary_factor": PARTIAL}})
    cfg = MiMoV2FlashConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
         "modules_to_not_convert": NOT_CONVERTED}


def release_config(cfg):
    """config.json in the release's format (the keys of XiaomiMiMo/MiMo-V2-Flash's config.json)."""
    return {
        "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "v_head_dim": cfg.v_head_dim,
        "swa_num_attention_heads": cfg.num_attention_heads, "swa_num_key_value_heads": 2 * cfg.num_key_value_heads,
        "swa_head_dim": cfg.head_dim, "swa_v_head_dim": cfg.v_head_dim,
        "hybrid_layer_pattern": PATTERN, "moe_layer_freq": MOE_FREQ,
        "sliding_window": WINDOW_SIZE, "sliding_window_size": WINDOW_SIZE, "attention_chunk_size": WINDOW_SIZE,
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "rope_theta": THETA, "swa_rope_theta": SWA_THETA, "partial_rotary_factor": PARTIAL,
        "attention_value_scale": cfg.attention_value_scale, "attention_bias": False, "attention_dropout": 0.0,
        "hidden_act": "silu", "layernorm_epsilon": cfg.rms_norm_eps, "max_position_embeddings":
        cfg.max_position_embeddings, "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True,
        "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "n_shared_experts": None, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "routed_scaling_factor": cfg.routed_scaling_factor, "bos_token_id": None, "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "bfloat16", "quantization_config": QUANT,
    }


def quantized_name(k):
    return k.startswith("model.layers.") and any(k.endswith(f".{n}.weight") for n in LINEARS)


def with_config(d, cfg_dict, weights):
    """A directory holding cfg_dict as config.json and `weights` linked as model.safetensors."""
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_dict, f)
    os.symlink(os.path.abspath(weights), os.path.join(d, "model.safetensors"))
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "quant"))
    a = ap.parse_args()
    out = os.path.join(a.out, NAME)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(8642)
    cfg = hf_config()
    model = MiMoV2FlashForCausalLM(cfg).eval()
    init_weights(model, gen)
    add_routing_channel(model, gen)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    keep = [(g, g.weight.data.clone(), g.e_score_correction_bias.data.clone()) for _, g, _ in moe_gates(model)]
    tmp = tempfile.mkdtemp()
    try:
        model.to(torch.bfloat16)
        for g, w, b in keep:  # F32 in the file, as the release keeps them
            g.weight.data = w
            g.e_score_correction_bias.data = b
        model.save_pretrained(tmp, safe_serialization=True)
        sd = load_file(os.path.join(tmp, "model.safetensors"))
    finally:
        shutil.rmtree(tmp)
    tensors, exact, n_q = {}, {}, 0
    for k, v in sd.items():
        if quantized_name(k):
            q, s = fp8_blocks(v.float())
            tensors[k] = q
            tensors[k[:-len("weight")] + "weight_scale_inv"] = s
            exact[k] = fp8_block_dequant(q, s)
            n_q += 1
        else:
            tensors[k] = v.contiguous()
            exact[k] = v.float()
    # transformers' fp8 loader takes a partial block spanning several scale rows as rows / scale rows
    # (192 rows in 2 blocks: 96 each), not as 128 + 64 (DeepSeek's, vLLM's and atomc's): keep to
    # whole blocks, or one partial block, where the two agree.
    assert all(t.shape[0] % BLOCK == 0 or t.shape[0] < BLOCK for k, t in tensors.items() if quantized_name(k))
    weights = os.path.join(out, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(release_config(cfg), f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": cfg.eos_token_id}, f)
        f.write("\n")

    hf_dict = cfg.to_dict()
    d1, d2 = tempfile.mkdtemp(), tempfile.mkdtemp()
    try:
        exact_path = os.path.join(d1, "exact.safetensors")
        save_file({k: v.contiguous() for k, v in exact.items()}, exact_path, metadata={"format": "pt"})
        ref = AutoModelForCausalLM.from_pretrained(with_config(tempfile.mkdtemp(dir=d1), hf_dict, exact_path),
                                                   dtype=torch.float32, attn_implementation="eager").float().eval()
        fp8 = AutoModelForCausalLM.from_pretrained(
            with_config(d2, dict(hf_dict, quantization_config=QUANT), weights), dtype=torch.float32,
            attn_implementation="eager",
            quantization_config=FineGrainedFP8Config(weight_block_size=(BLOCK, BLOCK), dequantize=True)).float().eval()
        g2 = torch.Generator().manual_seed(2027)
        with torch.no_grad():
            for n in (6, 37):
                ids = torch.randint(4, cfg.vocab_size, (1, n), generator=g2)
                check_close(f"{NAME} logits (transformers fp8 loader vs exact), len {n}", fp8(ids).logits.float(),
                            ref(ids).logits.float(), 2 ** -5)
        del fp8
        gaps, handles = gap_hooks(ref)
        prompts = references(ref, torch.Generator().manual_seed(4321))
        for h in handles:
            h.remove()
        hooked = 0
        for mname, mod in ref.named_modules():
            if any(mname.startswith("model.layers.") and mname.endswith("." + n) for n in LINEARS):
                mod.register_forward_pre_hook(lambda m, args: (fake_quant_fp8(args[0].float(), BLOCK),))
                hooked += 1
            elif type(mod).__name__ == "MiMoV2FlashExperts":
                mod.forward = experts_forward_w8a8(BLOCK).__get__(mod)
                hooked += 3 * mod.num_experts
        assert hooked == n_q, (hooked, n_q)
        prompts_w8a8 = references(ref, torch.Generator().manual_seed(4321))
    finally:
        shutil.rmtree(d1)
        shutil.rmtree(d2)
    kmin = min(gaps["key"])
    assert kmin >= MIN_KEY_GAP and gaps["bias_changes"] > 0, (kmin, gaps["bias_changes"])
    with open(os.path.join(out, "refs.json"), "w") as f:
        json.dump(dict(model=NAME, generator="tools/make_tiny_mimo_fp8.py",
                       reference="transformers fp32 MiMoV2FlashForCausalLM (the equivalent MiMoV2FlashConfig), eager "
                                 "attention, quantized weights = the fp8 blocks' exact fp32 dequantization",
                       transformers=__import__("transformers").__version__, router_min_key_gap=kmin,
                       bias_changed_decisions=gaps["bias_changes"], prompts=prompts), f, separators=(",", ":"))
        f.write("\n")
    with open(os.path.join(out, "refs_w8a8.json"), "w") as f:
        json.dump(dict(model=NAME, generator="tools/make_tiny_mimo_fp8.py",
                       reference="as refs.json, with the input activations of every quantized linear fake-quantized to "
                                 "fp8 e4m3 (dynamic, per token and 128-column group; experts per gathered token rows "
                                 "and on their SiLU x up output)",
                       transformers=__import__("transformers").__version__, prompts=prompts_w8a8), f,
                  separators=(",", ":"))
        f.write("\n")
    d = max(abs(x - y) for p, q in zip(prompts_w8a8, prompts) for r, t in zip(p["logits"], q["logits"])
            for x, y in zip(r, t))
    print(f"{NAME}: max |W8A8 - weight-only logit| = {d:.4f}")
    mins = min(min(p["greedy_margins"]) for p in prompts)
    scale = max(max(abs(x) for row in p["logits"] for x in row) for p in prompts)
    print(f"{NAME}: {n_q} FP8 linears, router min key gap {kmin:.4f}, max|logit| {scale:.2f}, min greedy margin "
          f"{mins:.4f}")


if __name__ == "__main__":
    main()
