#!/usr/bin/env python3
"""Writes tiny random-weight DeepSeek Sparse Attention models (MLA plus the lightning indexer) and
their transformers references into tests/fixtures/models/<name>:
    glm5_dsa          GlmMoeDsaForCausalLM (GLM-5): interleaved indexer RoPE, cross-layer top-k sharing
    deepseek_v32_dsa  DeepseekV32ForCausalLM (DeepSeek-V3.2): half-split indexer RoPE, an indexer on
                      every layer

Shape: hidden 64, 3 layers, 4 heads, q_lora 48, kv_lora 64, nope 32 / rope 32 / v 32 (as the
deepseek_v3 fixture), every layer dense (first_k_dense_replace 3: the DeepSeek MoE routing has its
own fixtures; this one is about the indexer), indexer index_n_heads 4, index_head_dim 48 (32 roped
+ 16 pass-through), index_topk 8; glm5_dsa with indexer_types ["full", "shared", "full"] (layer 1
reuses layer 0's top-k, GLM-5's cross-layer sharing). Prompts of 5, 13 and 24 tokens, so the 13- and 24-token
ones select 8 of up to 24 past tokens per query; 4 greedy tokens each.

Files (bf16 storage, fp32 eager references): config.json, model.safetensors, refs.json (the
sparse model) and refs_dense.json (the same weights with index_topk 4096, i.e. dense MLA: the
sparse logits must differ from these where the context exceeds 8).

Selections that survive BF16: the indexers are structured (structure_indexer: scores ride on one
RoPE pair as a strictly monotone function of distance, one factor per query), because random
indexers leave near-ties that BF16 activations flip (transformers' own BF16 forward of the earlier
random DeepSeek-V3.2 fixture was 2.4 off its fp32 one, as the CUDA backend was). The seed is
chosen so that at every query whose context exceeds index_topk the 8th and 9th best scores differ
by at least TOPK_GAP relative to the largest score of that query, and a BF16 copy of the model
(weights and activations) selects exactly the same lists on every prompt and greedy continuation.
refs.json records the gap (topk_min_gap).

Run (CPU, about a minute): python3 tools/make_tiny_dsa.py [--out tests/fixtures/models] [--only NAME]
"""
import argparse
import copy
import json
import math
import os
import sys

import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_models import init_weights, make_config  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                 v_head_dim=32, head_dim=32, first_k_dense_replace=3, n_routed_experts=8, moe_intermediate_size=32,
                 num_experts_per_tok=2, n_shared_experts=1, index_n_heads=4, index_head_dim=48, index_topk=8,
                 max_position_embeddings=256, rope_theta=10000.0, num_nextn_predict_layers=0)
# name: (config class, model class, overrides, indexer RoPE interleaved, seed base)
MODELS = {
    "glm5_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, dict(COMMON, indexer_types=["full", "shared", "full"]), True,
                 5150),
    "deepseek_v32_dsa": (DeepseekV32Config, DeepseekV32ForCausalLM, dict(COMMON, n_group=1, topk_group=1), False,
                         6150),
}
LENGTHS = (5, 13, 24)
GREEDY = 4
TOPK_GAP = 1e-2
ROPE_PAIR = 5  # the indexer RoPE pair (frequency 10000^(-10/32) = 0.056 rad per position) the scores ride on


def structure_indexer(model, interleaved, gen):
    """Makes every indexer's top-k a well-separated function of distance, so that BF16 activations
    (the CUDA backend's) select what fp32 HF selects. Random indexers put the 8th and 9th best
    scores of some query within BF16 noise of each other: HF itself in BF16 then picks other keys
    and lands logits ~2 off its fp32 forward. Here head h's query is s_h (x) u (s_h = v_h . q_resid,
    u one at the first dim of RoPE pair ROPE_PAIR and at the first pass-through dim), heads in +/-
    pairs (v_{2m+1} = -v_{2m}: one of each pair has relu > 0), head weights of one sign per query
    (weights_proj rows (0.6 + 0.2 h) v: no cancellation between heads, whose BF16 rounding
    differs), and the key is the LayerNorm bias b
    (B (cos P, -sin P) on that RoPE pair, K0 at the pass-through dim) plus 1% of the normed token part.
    Then q_h . k_j = s_h (B cos((i - j) theta + P) + K0 + noise), so a query's scores are
    C_i (f(i - j) + noise) with one factor C_i (its sign picks the nearest or the farthest keys) and
    f positive and strictly decreasing over the fixtures' distances (< 28 positions: the angle stays
    in [P, pi), and the phase P = 0.5 keeps the slope away from 0 at distance 0): relative gaps of
    2-3%, against BF16's ~0.4%.
    The RoPE layout still decides which dims form the pair (2a, 2a+1) or (a, a + R/2), so a wrong
    layout moves the selection."""
    B, K0, P = 2.0, 2.4, 0.5
    with torch.no_grad():
        for layer in model.model.layers:
            ix = layer.self_attn.indexer
            if ix is None:
                continue
            H, D, R = ix.n_heads, ix.head_dim, ix.qk_rope_head_dim
            a = 2 * ROPE_PAIR if interleaved else ROPE_PAIR
            a2 = a + 1 if interleaved else a + R // 2  # its partner in the rotation
            n0 = R  # the first pass-through dim
            w = torch.zeros(H, D, ix.wq_b.weight.shape[1])
            for m in range(H // 2):
                v = torch.randn(ix.wq_b.weight.shape[1], generator=gen) * (1.5 / ix.wq_b.weight.shape[1] ** 0.5)
                for h, sg in ((2 * m, 1.0), (2 * m + 1, -1.0)):
                    w[h, a] = sg * v
                    w[h, n0] = sg * v
            ix.wq_b.weight.copy_(w.view(H * D, -1))
            wv = torch.randn(ix.weights_proj.weight.shape[1], generator=gen) * (1.5 / ix.weights_proj.weight.shape[1] ** 0.5)
            ix.weights_proj.weight.copy_(torch.stack([wv * (0.6 + 0.2 * h) for h in range(H)]))
            ix.k_norm.weight.copy_(0.01 * torch.randn(D, generator=gen))
            b = torch.zeros(D)
            b[a], b[a2], b[n0] = B * math.cos(P), -B * math.sin(P), K0
            ix.k_norm.bias.copy_(b)


def indexer_scores(ix, hidden, q_resid, pos, interleaved):
    """index_scores (S, S) of GlmMoeDsaIndexer for one sequence (causal, -inf above the diagonal)."""
    S = hidden.shape[0]
    H, D, R = ix.n_heads, ix.head_dim, ix.qk_rope_head_dim
    q = ix.wq_b(q_resid).view(S, H, D).float()
    k = ix.k_norm(ix.wk(hidden)).float()

    def rope(x):  # pairs (2i, 2i+1) or (i, i + R/2) of the first R dims (the output layout is free)
        inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float) / R))
        ang = pos.float()[:, None] * inv[None, :]
        c, s = ang.cos(), ang.sin()
        if x.dim() == 3:
            c, s = c[:, None, :], s[:, None, :]
        x1, x2 = (x[..., 0:R:2], x[..., 1:R:2]) if interleaved else (x[..., :R // 2], x[..., R // 2:R])
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., R:]], dim=-1)
    q, k = rope(q), rope(k)
    sc = torch.relu(torch.einsum("shd,td->sht", q, k) * ix.softmax_scale)
    w = ix.weights_proj(hidden).float() * H ** -0.5
    out = torch.einsum("sh,sht->st", w, sc)
    return out.masked_fill(torch.ones(S, S).triu(1).bool(), float("-inf"))


def topk_gap(model, seqs, interleaved):
    """The smallest relative gap between the topk-th and next score over every query whose
    context exceeds index_topk, at every full indexer layer; and the same for the indexer run by
    transformers (its selection must equal the recomputed one)."""
    rec = {}

    def attn_hook(mod, args, kwargs):
        rec[mod.layer_idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    hs = [layer.self_attn.register_forward_pre_hook(attn_hook, with_kwargs=True) for layer in model.model.layers]
    gaps = []
    K = model.config.index_topk
    with torch.no_grad():
        for s in seqs:
            rec.clear()
            model(torch.tensor([s]))
            for li, layer in enumerate(model.model.layers):
                ix = layer.self_attn.indexer
                if ix is None:
                    continue
                x = rec[li][0]
                at = layer.self_attn
                q_resid = at.q_a_layernorm(at.q_a_proj(x))
                sc = indexer_scores(ix, x, q_resid, torch.arange(x.shape[0]), interleaved)
                for i in range(K, x.shape[0]):
                    top = torch.topk(sc[i, :i + 1], K + 1).values
                    gaps.append(float((top[K - 1] - top[K]) / max(float(top[0].abs()), 1e-6)))
    for h in hs:
        h.remove()
    return min(gaps)


def selections(model, seqs):
    """Per sequence, every indexer layer's top-k lists (sorted) from one forward."""
    out, hooks, cur = [], [], {}
    for li, layer in enumerate(model.model.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda mod, args, o, li=li: cur.__setitem__(li, o[0].sort(-1).values.clone())))
    with torch.no_grad():
        for s in seqs:
            cur.clear()
            model(torch.tensor([s]))
            out.append(dict(cur))
    for h in hooks:
        h.remove()
    return out


def bf16_flips(model, seqs):
    """Query rows whose top-k list differs between this fp32 model and its BF16 copy (BF16 weights
    and activations, what the CUDA backend runs): must be none."""
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    a, b = selections(model, seqs), selections(m16, seqs)
    return sum(int((x[li] != y[li]).any(-1).sum()) for x, y in zip(a, b) for li in x)


def refs(model, prompts):
    out = []
    for ids in prompts:
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        n = ids.shape[1]
        positions = sorted({0, n // 2, n - 1})
        seq, greedy, margins = ids, [], []
        with torch.no_grad():
            for _ in range(GREEDY):
                top2 = torch.topk(model(seq).logits[0, -1].float(), 2)
                greedy.append(int(top2.indices[0]))
                margins.append(round(float(top2.values[0] - top2.values[1]), 6))
                seq = torch.cat([seq, top2.indices[:1].view(1, 1)], dim=1)
        out.append(dict(ids=ids[0].tolist(), logit_positions=positions,
                        logits=[[round(float(x), 6) for x in logits[p]] for p in positions], greedy=greedy,
                        greedy_margins=margins))
    return out


def make(name, out):
    cfg_cls, model_cls, overrides, interleaved, seed = MODELS[name]
    for attempt in range(50):
        gen = torch.Generator().manual_seed(seed + attempt)
        cfg = make_config(cfg_cls, overrides)
        model = model_cls(cfg).eval()
        init_weights(model, gen)
        structure_indexer(model, interleaved, gen)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        prompts = [torch.randint(4, cfg.vocab_size, (1, n), generator=gen) for n in LENGTHS]
        sparse = refs(model, prompts)
        seqs = [p["ids"] + p["greedy"] for p in sparse]
        gap = topk_gap(model, seqs, interleaved)
        flips = bf16_flips(model, seqs)
        print(f"{name} attempt {attempt}: top-k min relative gap {gap:.2e}, {flips} rows select otherwise in BF16")
        if gap >= TOPK_GAP and flips == 0:
            break
    else:
        raise SystemExit(f"{name}: no seed with a clear top-k selection")
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    os.chmod(os.path.join(d, "model.safetensors"), 0o644)
    # The saved checkpoint reloaded in fp32 (its RoPE buffers fresh, not bf16-rounded): the same sparse
    # logits, and with index_topk 4096 the dense ones.
    again = model_cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    check = refs(again, prompts)
    err = max(abs(x - y) for p, q in zip(sparse, check) for r, s in zip(p["logits"], q["logits"]) for x, y in zip(r, s))
    assert err < 1e-4, f"reloaded checkpoint differs from the generated model by {err}"
    dense_model = model_cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                            index_topk=4096).eval()
    assert all(layer.self_attn.indexer is None or layer.self_attn.indexer.index_topk == 4096
               for layer in dense_model.model.layers)
    dense = refs(dense_model, prompts)
    diff = max(abs(x - y) for p, q in zip(sparse, dense) for r, s in zip(p["logits"], q["logits"])
               for x, y in zip(r, s))
    for fn, pr, what in (("refs.json", sparse, "sparse (index_topk 8)"),
                         ("refs_dense.json", dense, "dense (index_topk 4096)")):
        with open(os.path.join(d, fn), "w") as f:
            json.dump(dict(model=name, storage_dtype="bfloat16", generator="tools/make_tiny_dsa.py",
                           reference=f"transformers fp32 {model_cls.__name__}, eager attention, {what}",
                           transformers=__import__("transformers").__version__, topk_min_gap=round(gap, 6),
                           prompts=pr), f, separators=(",", ":"))
            f.write("\n")
    gen_cfg = os.path.join(d, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    print(f"{name}: top-k min gap {gap:.2e}; max |sparse - dense logit| = {diff:.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    ap.add_argument("--only", default=None)
    a = ap.parse_args()
    for name in MODELS:
        if a.only is None or a.only == name:
            make(name, a.out)


if __name__ == "__main__":
    main()
