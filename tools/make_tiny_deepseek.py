#!/usr/bin/env python3
"""Writes tiny random-weight DeepSeek-V2 / DeepSeek-V3 HF checkpoints (multi-head latent
attention, shared experts, DeepSeek routing) and their HF transformers references into
tests/fixtures/models/<name>/, in the format of tools/make_tiny_models.py (whose helpers it
reuses): config.json, generation_config.json, model.safetensors, refs.json.

Fixtures (bf16 storage, fp32 eager references):
    deepseek_v2  DeepseekV2ForCausalLM: no q_lora (direct q_proj), kv_lora_rank 64, nope 32 /
                 rope 32 / v 48 (v differs from the q/k head), YaRN (factor 4 with mscale 1.0 and
                 mscale_all_dim 0.707, so both the cos/sin factor and the softmax-scale correction
                 are exercised; prompts + greedy tokens pass original_max_position 32), 8 routed
                 experts top-2 greedy softmax, 2 shared experts, routed_scaling_factor 1.5, 3 MoE
                 layers (first_k_dense_replace 0).
    deepseek_v3  DeepseekV3ForCausalLM: q_lora_rank 48, kv_lora_rank 64, nope 32 / rope 32 / v 32,
                 rope_interleave, first layer dense (first_k_dense_replace 1), 8 routed experts in
                 4 groups of 2, topk_group 2, top-3 (more than a group holds), noaux_tc sigmoid
                 scoring with a random e_score_correction_bias, norm_topk_prob, 1 shared expert,
                 routed_scaling_factor 2.5.
    deepseek_v3_192  deepseek_v3 with DeepSeek-V3's per-head dims (nope 128 / rope 64 / v 128, q/k
                 head 192) on 2 heads and 2 layers (dense, MoE): the head shape for which the CUDA backend runs prefill
                 chunks of >= 16 tokens expanded on the tensor cores (cuda_mla.cu), so the 19- and
                 37-token prompts take that path in tests/gpu/test_cuda_models.c.

Routing decisions are made clear of ties and of BF16 noise as in tools/make_tiny_moe_models.py (a
"routing channel" of the last ROUTE_DIMS hidden dims that only the embeddings write, read by the
router with large weights; per-token codes drawn until the decision has a clear gap), with the
gap measured in the quantity each method selects by: V2 the softmax probability (k-th vs
(k+1)-th; >= 2e-2), V3 the biased sigmoid score, both the group scores (topk_group-th vs next
group) and the expert scores inside the chosen groups (>= 5e-3; sigmoid scores are flatter and
their order under the bias is not scale-invariant, see ROUTING / RMS_GRID). refs.json records
router_min_gap (in those units) and bf16_routing_flips (0). Seeds are tried in order until both
hold (V2: attempt 6, V3: attempt 0).

Note on V2's norm_topk_prob: transformers' DeepseekV2 router never renormalises (the original
DeepSeek code and vLLM do when norm_topk_prob is true); the fixture keeps it false, where all agree.

Run (CPU, ~1 minute):  python3 tools/make_tiny_deepseek.py [--out tests/fixtures/models]
"""
import argparse
import copy
import json
import os
import sys

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_models import init_weights, make_config, references  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
              moe_intermediate_size=32, n_routed_experts=8, max_position_embeddings=256,
              head_dim=32)  # transformers sets head_dim = qk_rope_head_dim (make_config's base says 64)

MODELS = {
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM,
                    dict(COMMON, q_lora_rank=None, v_head_dim=48, num_experts_per_tok=2, n_shared_experts=2,
                         topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.5,
                         first_k_dense_replace=0, rope_theta=10000.0,
                         rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                           beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707))),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM,
                    dict(COMMON, q_lora_rank=48, v_head_dim=32, num_experts_per_tok=3, n_shared_experts=1,
                         n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                         first_k_dense_replace=1, rope_interleave=True, rope_theta=10000.0)),
    "deepseek_v3_192": (DeepseekV3Config, DeepseekV3ForCausalLM,
                        dict(COMMON, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, head_dim=64, v_head_dim=128, q_lora_rank=48, num_experts_per_tok=3,
                             n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                             routed_scaling_factor=2.5, first_k_dense_replace=1, rope_interleave=True,
                             rope_theta=10000.0)),
}

ROUTE_DIMS = 8
RMS_RANGE = (1.0, 1.5, 2.0, 3.0, 4.0)
# Per method: (scale of the router weights on the non-channel dims, std of a token's channel-only
# router logits, selection-quantity gap of a token's code at every RMS in RMS_RANGE, the same gap
# required on the references' actual router inputs). Sigmoid scores saturate for large logits and
# group scores add two of them, so V3 keeps the codes moderate, the context contribution smaller
# and asks for gaps in its own units.
ROUTING = {"softmax": (0.05, 3.5, 0.06, 2e-2), "sigmoid": (0.005, 2.5, 0.03, 5e-3)}
# Softmax order is invariant to the RMSNorm's positive scale, so a few RMS values suffice; sigmoid
# scores plus a correction bias are not (the order can cross between two RMS values), so V3's codes
# are checked on a dense grid over the range the residual stream takes.
RMS_GRID = {"softmax": RMS_RANGE, "sigmoid": tuple(0.8 + 0.15 * i for i in range(30))}


def bf16(t):
    return t.to(torch.bfloat16).float()


def gates_of(model):
    out = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            out.append((i, gate, layer.post_attention_layernorm.weight))
    return out


def select(gate, logits):
    """(sorted expert ids (T, k), smallest selection gap over the T rows) of the gate's method on
    router logits (T, E), fp32, as transformers computes it."""
    k, E = gate.top_k, logits.shape[-1]
    if hasattr(gate, "e_score_correction_bias"):  # V3 noaux_tc
        G, TG = gate.num_group, gate.topk_group
        choice = logits.sigmoid() + gate.e_score_correction_bias.float()
        top2 = choice.view(-1, G, E // G).topk(2, dim=-1)[0]
        gs = top2.sum(-1)
        gsorted = torch.sort(gs, -1, descending=True).values
        ggap = gsorted[:, TG - 1] - gsorted[:, TG] if TG < G else torch.full_like(gs[:, 0], 1e9)
        gidx = torch.topk(gs, TG, dim=-1).indices
        mask = torch.zeros_like(gs).scatter_(1, gidx, 1).bool().unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        masked = choice.masked_fill(~mask, float("-inf"))
        top = torch.topk(masked, k + 1 if k < TG * (E // G) else k, dim=-1)
        egap = top.values[:, k - 1] - top.values[:, k] if k < TG * (E // G) else torch.full_like(ggap, 1e9)
        ids = torch.sort(top.indices[:, :k], -1).values
        return ids, float(torch.minimum(ggap, egap).min())
    probs = torch.softmax(logits, -1)
    top = torch.topk(probs, k + 1, dim=-1)
    return torch.sort(top.indices[:, :k], -1).values, float((top.values[:, k - 1] - top.values[:, k]).min())


def method(model):
    return "sigmoid" if any(hasattr(g, "e_score_correction_bias") for _, g, _ in gates_of(model)) else "softmax"


def add_routing_channel(model, gen):
    context_scale, code_std, min_code_gap, _ = ROUTING[method(model)]
    rms_grid = RMS_GRID[method(model)]
    hidden = model.config.hidden_size
    rc = slice(hidden - ROUTE_DIMS, hidden)
    gates = gates_of(model)
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
            gate.weight[:, :hidden - ROUTE_DIMS] *= context_scale
            gate.weight[:, rc] = torch.randn(gate.weight[:, rc].shape, generator=gen) * (
                code_std / ROUTE_DIMS ** 0.5)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(0.1 * torch.randn(gate.e_score_correction_bias.shape,
                                                                     generator=gen))
        emb = model.model.embed_tokens.weight
        for tok in range(emb.shape[0]):
            for _ in range(100000):
                code = bf16(torch.randn(ROUTE_DIMS, generator=gen))
                ok = True
                for _, gate, norm_w in gates:
                    lg = bf16(gate.weight[:, rc]) @ (code * bf16(norm_w[rc]))
                    if select(gate, lg.view(1, -1) / torch.tensor(rms_grid).view(-1, 1))[1] < min_code_gap:
                        ok = False
                    if not ok:
                        break
                if ok:
                    break
            else:
                raise SystemExit(f"no routing code with a clear selection for token {tok}")
            emb[tok, rc] = code


def routing_hooks(model, record):
    def hook(mod, inp, out):
        record.append(select(mod, out[0].float()))
    return [gate.register_forward_hook(hook) for _, gate, _ in gates_of(model)]


def routing_of(model, seqs):
    rec = []
    hs = routing_hooks(model, rec)
    with torch.no_grad():
        for s in seqs:
            model(torch.tensor([s]))
    for h in hs:
        h.remove()
    return [ids for ids, _ in rec]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    ap.add_argument("--only", default=None, help="write only this fixture")
    args = ap.parse_args()
    torch.manual_seed(0)
    for i, (name, (cfg_cls, model_cls, overrides)) in enumerate(MODELS.items()):
        if args.only and name != args.only:
            continue
        for attempt in range(20):
            gen = torch.Generator().manual_seed(777 + 100 * i + attempt)
            cfg = make_config(cfg_cls, overrides)
            model = model_cls(cfg).eval()
            init_weights(model, gen)
            add_routing_channel(model, gen)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
                for _, gate, _ in gates_of(model):
                    if hasattr(gate, "e_score_correction_bias"):
                        gate.e_score_correction_bias.copy_(bf16(gate.e_score_correction_bias))
            rec = []
            hs = routing_hooks(model, rec)
            refs = references(model, gen)
            for h in hs:
                h.remove()
            gap = min(g for _, g in rec)
            seqs = [p["ids"] + p["greedy"] for p in refs]
            ref_ids = routing_of(model, seqs)
            low_ids = routing_of(copy.deepcopy(model).to(torch.bfloat16), seqs)
            flips = sum(int((a != b).any(-1).sum()) for a, b in zip(ref_ids, low_ids))
            print(f"{name} attempt {attempt}: router min gap {gap:.4f}, {flips} BF16 routing flips")
            if gap >= ROUTING[method(model)][3] and flips == 0:
                break
        else:
            raise SystemExit(f"{name}: no seed gives routing clear of BF16 noise")
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
        with open(os.path.join(d, "refs.json"), "w") as f:
            json.dump(dict(model=name, storage_dtype="bfloat16", generator="tools/make_tiny_deepseek.py",
                           transformers=__import__("transformers").__version__, router_min_gap=gap,
                           bf16_routing_flips=flips, prompts=refs), f, separators=(",", ":"))
            f.write("\n")
        mins = min(min(p["greedy_margins"]) for p in refs)
        scale = max(max(abs(x) for row in p["logits"] for x in row) for p in refs)
        print(f"{name}: max|logit|={scale:.2f} min greedy margin={mins:.4f} router min gap={gap:.4f}")


if __name__ == "__main__":
    main()
