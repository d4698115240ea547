#!/usr/bin/env python3
"""Writes tiny random-weight GLM-4-MoE checkpoints (Glm4MoeForCausalLM) and their HF transformers
reference outputs into tests/fixtures/models/<name>/, in the format of tools/make_tiny_models.py
and tools/make_tiny_moe_models.py (config.json, generation_config.json, model.safetensors with
per-expert tensors as transformers saves them, refs.json: logits at several positions, 16 greedy
tokens with their top-1/top-2 margins), and the same for MiMo-V2-Flash (MiMoV2FlashForCausalLM).

Fixtures (head_dim 64 so the CUDA attention runs them; bf16 storage except the F32
e_score_correction_bias, as GLM ships it; fp32 references):
    glm4_moe      8 experts top-3 in 4 groups of 2, topk_group 2 (groups smaller than top-k), one
                  shared expert, first_k_dense_replace 1, routed_scaling_factor 2.5, q/k norm,
                  attention bias, partial_rotary_factor 0.5, a num_nextn_predict_layers = 1 MTP
                  layer in the checkpoint (atomc skips it by name)
    glm4_moe_air  8 experts top-2 ungrouped, two shared experts (one shared MLP of 2 x the
                  expert size), no renormalisation, no q/k norm, first_k_dense_replace 2,
                  partial_rotary_factor 0.25

MiMo-V2-Flash fixture (head_dim 48 for q/k, v_head_dim 32; bf16 storage except the F32 router
weight and e_score_correction_bias, as the real checkpoint keeps them):
    mimo_v2_flash layer_types full / sliding / sliding / full with sliding_window 8 (crossed by the
                  19- and 37-token prompts), sliding layers with twice the KV heads (2 vs 1) and
                  per-head sinks, rope_parameters per layer type (full: theta 1e6, partial 0.334
                  -> 16 rotary dims; sliding: theta 1e4, partial 0.5 -> 24), attention_value_scale
                  0.707, mlp_layer_types dense / sparse / sparse / sparse, 8 experts top-2 in one
                  group, sigmoid routing with a correction bias, routed_scaling_factor 1.5, no
                  shared experts; an MTP tensor under model.mtp.* (skipped by atomc, as HF does)
    mimo_v2_flash_hd192  the real model's head dims (q/k 192, v 128: the CUDA attention's pair),
                  3 layers full / sliding / full, 2 heads, 1 vs 2 KV heads, window 8, partial
                  0.334 (64 dims) / 0.5 (96), 4 experts top-2; also refs_dense.json: HF's fp32
                  logits at every other position and the last, with HF's own BF16 run's max error
                  there (router and bias kept F32), for tests/gpu/test_cuda_mimo.c

Routing must be clear of ties and of BF16 noise (the CUDA backend runs the same fixtures in
BF16): as in make_tiny_moe_models.py a "routing channel" of ROUTE_DIMS hidden dims only the
embeddings write carries a per-token code the routers read with large weights; here the codes
are drawn until, at every residual RMS of RMS_RANGE, the selection keys sigmoid(logit) + bias
give a clear choice of groups (the topk_group-th vs the next group score) and of experts within
the kept groups (k-th vs (k+1)-th key). refs.json records router_min_key_gap and
router_min_group_gap over every token and MoE layer of the references, and
bf16_routing_flips (0): the routing decisions a BF16 forward makes differently, and how many
decisions the correction bias and the group limit change (bias_changed_decisions,
groups_changed_decisions: both > 0 where they apply, so a router ignoring either fails the
logits comparison).

Run (CPU, ~1 minute):  python3 tools/make_tiny_glm_mimo.py [--out tests/fixtures/models] [--only glm | mimo |
NAME]
"""
import argparse
import copy
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, MiMoV2FlashConfig, MiMoV2FlashForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_models import init_weights, make_config, references  # noqa: E402

MODELS = {
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                     moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                     num_nextn_predict_layers=1, rope_theta=1000000.0, bos_token_id=None, eos_token_id=3),
    "glm4_moe_air": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=2,
                         moe_intermediate_size=32, first_k_dense_replace=2, num_hidden_layers=4,
                         routed_scaling_factor=1.0, norm_topk_prob=False, use_qk_norm=False, attention_bias=True,
                         partial_rotary_factor=0.25, num_nextn_predict_layers=0, rope_theta=10000.0,
                         bos_token_id=None, eos_token_id=3),
}

MIMO_MODELS = {
    "mimo_v2_flash": dict(num_hidden_layers=4, head_dim=48, v_head_dim=32, num_key_value_heads=1,
                          layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                          mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=8,
                          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0,
                                                              "partial_rotary_factor": 0.334},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                 "partial_rotary_factor": 0.5}},
                          attention_value_scale=0.707, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                          topk_group=1, moe_intermediate_size=32, routed_scaling_factor=1.5, norm_topk_prob=True,
                          bos_token_id=None, eos_token_id=3),
    # The real model's head dims (q/k 192, v 128), which the CUDA attention implements; the rest tiny.
    "mimo_v2_flash_hd192": dict(num_hidden_layers=3, num_attention_heads=2, head_dim=192, v_head_dim=128,
                                num_key_value_heads=1, intermediate_size=64,
                                layer_types=["full_attention", "sliding_attention", "full_attention"],
                                mlp_layer_types=["dense", "sparse", "sparse"], sliding_window=8,
                                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0,
                                                                    "partial_rotary_factor": 0.334},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                       "partial_rotary_factor": 0.5}},
                                attention_value_scale=0.707, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                topk_group=1, moe_intermediate_size=16, routed_scaling_factor=1.5,
                                norm_topk_prob=True, bos_token_id=None, eos_token_id=3),
}
# Fixtures that also get refs_dense.json (for BF16 backends: HF fp32 logits at every
# DENSE_STRIDE-th position and the last, and HF's own BF16 run's max |logit| error there, as
# tools/make_tiny_qwen3_next.py writes it; tests/gpu/test_cuda_mimo.c holds CUDA to that).
DENSE_REFS = {"mimo_v2_flash_hd192"}
DENSE_STRIDE = 2

ROUTE_DIMS = 8
ROUTER_CONTEXT_SCALE = 0.03
ROUTER_CODE_STD = 5.0
# The residual RMS the routers see in these fixtures is about 1.8 to 7.1. Sigmoid + bias keys can
# cross as the RMS moves, so the grid is dense.
RMS_RANGE = [1.0 + 0.25 * i for i in range(33)]  # 1.0 .. 9.0
BIAS_STD = 0.15
MIN_CODE_KEY_GAP = 0.07    # channel-only key gap (experts and groups) at every RMS in RMS_RANGE
MIN_KEY_GAP = 0.025        # checked on the references (fp32): sigmoid + bias keys, k-th vs (k+1)-th
MIN_GROUP_GAP = 0.025      # and group scores, topk_group-th vs the next


def moe_gates(model):
    out = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            out.append((i, gate, layer.post_attention_layernorm.weight))
    return out


def bf16(t):
    return t.to(torch.bfloat16).float()


def selection_gaps(keys, gate):
    """(expert gap, group gap) of the selection keys (..., E): the k-th vs (k+1)-th key among the
    experts of the kept groups, and the topk_group-th vs the next group score (inf without groups)."""
    E, k, ng, tg = keys.shape[-1], gate.top_k, gate.num_group, gate.topk_group
    keys = keys.reshape(-1, E)
    group_gap = torch.full((keys.shape[0],), float("inf"))
    mask = torch.ones_like(keys, dtype=torch.bool)
    if ng > 1:
        gs = keys.view(-1, ng, E // ng).topk(2, dim=-1).values.sum(-1)
        top = gs.topk(min(tg + 1, ng), dim=-1)
        if tg < ng:
            group_gap = top.values[:, tg - 1] - top.values[:, tg]
        kept = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, top.indices[:, :tg], True)
        mask = kept.unsqueeze(-1).expand(-1, ng, E // ng).reshape(-1, E)
    masked = keys.masked_fill(~mask, float("-inf"))
    n_kept = int(mask[0].sum())
    expert_gap = torch.full((keys.shape[0],), float("inf"))
    if k < n_kept:
        top = masked.topk(k + 1, dim=-1).values
        expert_gap = top[:, k - 1] - top[:, k]
    return expert_gap, group_gap


def selected(keys, gate):
    E, k, ng, tg = keys.shape[-1], gate.top_k, gate.num_group, gate.topk_group
    keys = keys.reshape(1, E)
    if ng > 1:
        gs = keys.view(1, ng, E // ng).topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(tg, dim=-1).indices, True)
        keys = keys.masked_fill(~kept.unsqueeze(-1).expand(-1, ng, E // ng).reshape(1, E), float("-inf"))
    return tuple(sorted(keys.topk(k, dim=-1).indices[0].tolist()))


def code_is_clear(code_logits, gate):
    """The same selection with clear gaps at every RMS of RMS_RANGE (unlike softmax, sigmoid keys
    plus a bias change order as the RMSNorm scale moves, so a sparse grid is not enough)."""
    first = None
    for rms in RMS_RANGE:
        keys = torch.sigmoid(code_logits / rms) + gate.e_score_correction_bias.float()
        eg, gg = selection_gaps(keys, gate)
        if float(eg.min()) < MIN_CODE_KEY_GAP or float(gg.min()) < MIN_CODE_KEY_GAP:
            return False
        sel = selected(keys, gate)
        if first is None:
            first = sel
        elif sel != first:
            return False
    return True


def add_routing_channel(model, gen):
    hidden = model.config.hidden_size
    rc = slice(hidden - ROUTE_DIMS, hidden)
    gates = moe_gates(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[rc, :] = 0
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                mlp.experts.down_proj[:, rc, :] = 0
            if hasattr(mlp, "down_proj"):
                mlp.down_proj.weight[rc, :] = 0
            if hasattr(mlp, "shared_experts"):
                mlp.shared_experts.down_proj.weight[rc, :] = 0
        for _, gate, _ in gates:
            gate.weight[:, :hidden - ROUTE_DIMS] *= ROUTER_CONTEXT_SCALE
            gate.weight[:, rc] = torch.randn(gate.weight[:, rc].shape, generator=gen) * (
                ROUTER_CODE_STD / ROUTE_DIMS ** 0.5)
            gate.weight.copy_(bf16(gate.weight))
            gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=gen) * BIAS_STD)
        emb = model.model.embed_tokens.weight
        for tok in range(emb.shape[0]):
            for _ in range(200000):
                code = bf16(torch.randn(ROUTE_DIMS, generator=gen))
                if all(code_is_clear(gate.weight[:, rc] @ (code * bf16(norm_w[rc])), gate) for _, gate, norm_w in gates):
                    break
            else:
                raise SystemExit(f"no routing code with a clear selection for token {tok}")
            emb[tok, rc] = code


def gap_hooks(model):
    """Hooks on every router that collect the smallest selection gaps per call and count the
    decisions the correction bias and the group limit change (the fixture must exercise both:
    with either one ignored, atomc's logits would not match)."""
    gaps = {"key": [], "group": [], "bias_changes": 0, "group_changes": 0}

    def hook(mod, inp, out):
        scores = torch.sigmoid(out[0].float())
        keys = scores + mod.e_score_correction_bias.float()
        eg, gg = selection_gaps(keys, mod)
        gaps["key"].append(float(eg.min()))
        gaps["group"].append(float(gg.min()))
        for row in range(keys.shape[0]):
            sel = selected(keys[row], mod)
            gaps["bias_changes"] += sel != selected(scores[row], mod)
            gaps["group_changes"] += sel != tuple(sorted(keys[row].topk(mod.top_k).indices.tolist()))

    return gaps, [gate.register_forward_hook(hook) for _, gate, _ in moe_gates(model)]


def routing_of(model, seqs):
    got = []

    def hook(mod, inp, out):
        got.append(torch.sort(out[2], -1).values)

    handles = [gate.register_forward_hook(hook) for _, gate, _ in moe_gates(model)]
    with torch.no_grad():
        for s in seqs:
            model(torch.tensor([s]))
    for h in handles:
        h.remove()
    return got


def bf16_routing_flips(model, refs):
    seqs = [p["ids"] + p["greedy"] for p in refs]
    ref = routing_of(model, seqs)
    low = copy.deepcopy(model).to(torch.bfloat16)
    for (_, g, _), (_, lg, _) in zip(moe_gates(model), moe_gates(low)):
        lg.e_score_correction_bias.data = g.e_score_correction_bias.data.clone()  # F32, as stored
    got = routing_of(low, seqs)
    return sum(int((a != b).any(-1).sum()) for a, b in zip(ref, got))


def dense_references(model, prompts):
    """HF fp32 logits at every DENSE_STRIDE-th position (and the last) of each prompt, and the max
    |logit| error of HF's own BF16 run there (router weight and correction bias kept F32, as the
    checkpoint stores them and atomc loads them)."""
    low = copy.deepcopy(model).to(torch.bfloat16)
    for (_, g, _), (_, lg, _) in zip(moe_gates(model), moe_gates(low)):
        lg.weight.data = g.weight.data.clone()
        lg.e_score_correction_bias.data = g.e_score_correction_bias.data.clone()
    out = []
    for p in prompts:
        ids = torch.tensor([p["ids"]])
        n = ids.shape[1]
        pos = sorted(set(list(range(0, n, DENSE_STRIDE)) + [n - 1]))
        with torch.no_grad():
            ref = model(ids, use_cache=False).logits[0].float()
            bf = low(ids, use_cache=False).logits[0].float()
        out.append(dict(ids=p["ids"], positions=pos, logits=[[round(float(x), 4) for x in ref[q]] for q in pos],
                        bf16_err=[round(float((bf[q] - ref[q]).abs().max()), 4) for q in pos]))
    return out


def add_mtp_layer(d, cfg, gen):
    """Appends a multi-token-prediction layer's tensors (GLM's names, random values) to the
    checkpoint, as model.layers.<num_hidden_layers>.*: transformers does not build the MTP module,
    real GLM checkpoints carry it, and atomc must skip it by name."""
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    extra = {
        f"model.layers.{L}.eh_proj.weight": (H, 2 * H),
        f"model.layers.{L}.enorm.weight": (H,),
        f"model.layers.{L}.hnorm.weight": (H,),
        f"model.layers.{L}.input_layernorm.weight": (H,),
        f"model.layers.{L}.shared_head.norm.weight": (H,),
        f"model.layers.{L}.mlp.gate.weight": (cfg.n_routed_experts, H),
    }
    for name, shape in extra.items():
        t[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(t, path, metadata={"format": "pt"})


def add_mimo_mtp(d, cfg, gen):
    """An MTP tensor under model.mtp.* as the real checkpoints carry (transformers ignores them on
    load; atomc skips them by name)."""
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    t["model.mtp.layers.0.enorm.weight"] = torch.ones(cfg.hidden_size, dtype=torch.bfloat16)
    t["model.mtp.layers.0.eh_proj.weight"] = (torch.randn((cfg.hidden_size, 2 * cfg.hidden_size), generator=gen)
                                              * 0.02).to(torch.bfloat16)
    save_file(t, path, metadata={"format": "pt"})


def make_mimo(name, overrides, args, gen):
    from make_tiny_models import BASE
    kw = dict(BASE)
    kw.update(overrides)
    cfg = MiMoV2FlashConfig(**kw)
    cfg._attn_implementation = "eager"
    model = MiMoV2FlashForCausalLM(cfg).eval()
    init_weights(model, gen)
    add_routing_channel(model, gen)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    gaps, handles = gap_hooks(model)
    refs = references(model, gen)
    for h in handles:
        h.remove()
    flips = bf16_routing_flips(model, refs)
    kmin = min(gaps["key"])
    print(f"{name}: router min key gap {kmin:.4f}, {flips} BF16 routing flips, "
          f"{gaps['bias_changes']} decisions changed by the bias")
    assert gaps["bias_changes"] > 0 and kmin >= MIN_KEY_GAP and flips == 0
    d = os.path.join(args.out, name)
    os.makedirs(d, exist_ok=True)
    if name in DENSE_REFS:
        dense = dense_references(model, refs)
        worst = max(max(p["bf16_err"]) for p in dense)
        print(f"{name}: HF BF16 run max |logit - fp32| {worst:.4f} over the dense positions")
        with open(os.path.join(d, "refs_dense.json"), "w") as f:
            json.dump(dict(model=name, generator="tools/make_tiny_glm_mimo.py", stride=DENSE_STRIDE, prompts=dense), f,
                      separators=(",", ":"))
            f.write("\n")
    keep = [(g, g.weight.data.clone(), g.e_score_correction_bias.data.clone()) for _, g, _ in moe_gates(model)]
    model.to(torch.bfloat16)
    for g, w, b in keep:  # F32 in the file, as MiMo-V2-Flash ships them
        g.weight.data = w
        g.e_score_correction_bias.data = b
    model.save_pretrained(d, safe_serialization=True)
    add_mimo_mtp(d, cfg, gen)
    with open(os.path.join(d, "refs.json"), "w") as f:
        json.dump(dict(model=name, storage_dtype="bfloat16", generator="tools/make_tiny_glm_mimo.py",
                       transformers=__import__("transformers").__version__, router_min_key_gap=kmin,
                       bias_changed_decisions=gaps["bias_changes"], bf16_routing_flips=flips, prompts=refs), f,
                  separators=(",", ":"))
        f.write("\n")
    mins = min(min(p["greedy_margins"]) for p in refs)
    scale = max(max(abs(x) for row in p["logits"] for x in row) for p in refs)
    print(f"{name}: max|logit|={scale:.2f} min greedy margin={mins:.4f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    ap.add_argument("--only", choices=["glm", "mimo"] + list(MIMO_MODELS),
                    help="write only the GLM-4-MoE fixtures, only the MiMo ones, or only the named MiMo fixture")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.only != "glm":
        for i, (name, overrides) in enumerate(MIMO_MODELS.items()):
            if args.only in (None, "mimo", name):
                make_mimo(name, overrides, args, torch.Generator().manual_seed(5432 + 100 * i))
    if args.only is not None and args.only != "glm":
        return
    torch.manual_seed(0)
    for i, (name, overrides) in enumerate(MODELS.items()):
        gen = torch.Generator().manual_seed(9876 + 100 * i)
        ov = dict(overrides)
        partial = ov.pop("partial_rotary_factor")
        cfg = make_config(Glm4MoeConfig, ov)
        cfg.rope_parameters["partial_rotary_factor"] = partial
        cfg = Glm4MoeConfig(**cfg.to_dict())
        cfg._attn_implementation = "eager"
        model = Glm4MoeForCausalLM(cfg).eval()
        init_weights(model, gen)
        add_routing_channel(model, gen)
        with torch.no_grad():  # bf16 storage: round first so the fp32 references are exact for it
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        gaps, handles = gap_hooks(model)
        refs = references(model, gen)
        for h in handles:
            h.remove()
        flips = bf16_routing_flips(model, refs)
        kmin, gmin = min(gaps["key"]), min(gaps["group"])
        print(f"{name}: router min key gap {kmin:.4f}, group gap {gmin:.4f}, {flips} BF16 routing flips, "
              f"{gaps['bias_changes']} decisions changed by the bias, {gaps['group_changes']} by the groups")
        assert gaps["bias_changes"] > 0 and (cfg.n_group == 1 or gaps["group_changes"] > 0)
        assert kmin >= MIN_KEY_GAP and gmin >= MIN_GROUP_GAP and flips == 0
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        biases = [g.e_score_correction_bias.data.clone() for _, g, _ in moe_gates(model)]
        model.to(torch.bfloat16)
        for (_, g, _), b in zip(moe_gates(model), biases):
            g.e_score_correction_bias.data = b  # F32 in the file, as GLM ships it
        model.save_pretrained(d, safe_serialization=True)
        if cfg.num_nextn_predict_layers > 0:
            add_mtp_layer(d, cfg, gen)
        with open(os.path.join(d, "refs.json"), "w") as f:
            json.dump(dict(model=name, storage_dtype="bfloat16", generator="tools/make_tiny_glm_mimo.py",
                           transformers=__import__("transformers").__version__,
                           router_min_key_gap=kmin, router_min_group_gap=gmin if gmin != float("inf") else None,
                           bias_changed_decisions=gaps["bias_changes"], groups_changed_decisions=gaps["group_changes"],
                           bf16_routing_flips=flips, prompts=refs), f, separators=(",", ":"))
            f.write("\n")
        mins = min(min(p["greedy_margins"]) for p in refs)
        scale = max(max(abs(x) for row in p["logits"] for x in row) for p in refs)
        print(f"{name}: max|logit|={scale:.2f} min greedy margin={mins:.4f}")


if __name__ == "__main__":
    main()
