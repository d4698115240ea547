#!/usr/bin/env python3
"""Per-GPU memory plan for the MLA models that need 8 GPUs (DeepSeek-V3/R1, Kimi-K2), for the
multi-GPU work: weight bytes (FP8 128x128-block checkpoint as shipped: linear weights 1 byte + one
fp32 scale per 128x128 block; embeddings, lm_head, norms, routers in bf16), latent-cache bytes per
token, and activation bytes per batched token, under
  TP8           attention heads and experts split 8 ways; the MLA latent (one shared KV head) is
                NOT split: every rank caches the whole latent of every sequence;
  DP8 + EP8     attention replicated per rank (each rank serves its own sequences: its latent cache
                holds only those), routed experts split 8 ways (32 / 48 per rank), shared expert and
                dense layers replicated.
Hyper-parameters are the models' published config.json values. Prints a markdown table
(docs/memory_planning.md holds its output).

usage: python3 tools/mla_memory_plan.py [--hbm-gib 141] [--batched-tokens 8192]"""
import argparse

MODELS = {
    "DeepSeek-V3 / R1": dict(vocab=129280, hidden=7168, inter=18432, moe_inter=2048, experts=256, shared=1,
                             layers=61, dense=3, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128,
                             mtp=1, topk=8),
    "Kimi-K2": dict(vocab=163840, hidden=7168, inter=18432, moe_inter=2048, experts=384, shared=1, layers=61,
                    dense=1, heads=64, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, mtp=0, topk=8),
}
BLOCK = 128


def fp8_bytes(rows, cols):
    return rows * cols + 4 * -(-rows // BLOCK) * -(-cols // BLOCK)


def attn_linears(c):
    h, H = c["hidden"], c["heads"]
    return [(c["q_lora"], h), (H * (c["nope"] + c["rope"]), c["q_lora"]), (c["kv_lora"] + c["rope"], h),
            (H * (c["nope"] + c["v"]), c["kv_lora"]), (h, H * c["v"])]


def mlp_linears(h, i):
    return [(2 * i, h), (h, i)]  # gate+up, down


def plan(c, tp, ep_dp):
    """Bytes per GPU: (attention, routed experts, shared+dense, embeddings+head+norms)."""
    h = c["hidden"]
    L = c["layers"] + c["mtp"]
    moe_layers = L - c["dense"]
    attn = sum(fp8_bytes(r, k) for r, k in attn_linears(c)) + 2 * (c["q_lora"] + c["kv_lora"] + 2 * h)
    expert = sum(fp8_bytes(r, k) for r, k in mlp_linears(h, c["moe_inter"]))
    dense = sum(fp8_bytes(r, k) for r, k in mlp_linears(h, c["inter"]))
    router = 2 * c["experts"] * h + 4 * c["experts"]
    mtp_extra = c["mtp"] * (fp8_bytes(h, 2 * h) + 2 * 3 * h)
    emb = 2 * 2 * c["vocab"] * h + 2 * h
    if tp:  # everything split 8 ways (replicated norms / routers are negligible)
        a = attn * L / 8
        r = moe_layers * c["experts"] * expert / 8
        s = (moe_layers * c["shared"] * expert + c["dense"] * dense + moe_layers * router) / 8
        e = emb / 8 + mtp_extra / 8
    else:   # DP attention (replicated), EP experts
        a = attn * L
        r = moe_layers * c["experts"] * expert / 8
        s = moe_layers * c["shared"] * expert + c["dense"] * dense + moe_layers * router
        e = emb + mtp_extra  # vocab-parallel lm_head would divide this by 8
    return a, r, s, e


def latent_bytes_per_token(c, dtype_bytes):
    return (c["layers"] + c["mtp"]) * (c["kv_lora"] + c["rope"]) * dtype_bytes


def activation_bytes_per_token(c, tp):
    """Peak live activations per batched token in one layer's forward (bf16), the larger of the
    attention side (q, expanded k/v for prefill, attention output) and the MoE side (top-k rows of
    gate+up and the intermediate), plus the residual stream; logits are per sampled row, not here."""
    h, H = c["hidden"], c["heads"] // (8 if tp else 1)
    attn = H * (c["nope"] + c["rope"]) + H * (c["nope"] + c["rope"]) + H * c["v"] + H * c["v"]
    moe = c["topk"] * (2 * c["moe_inter"] + c["moe_inter"]) + 2 * h
    return 2 * (max(attn, moe) + 3 * h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hbm-gib", type=float, default=141.0)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    a = ap.parse_args()
    G = 1 << 30
    print(f"| model | layout | attention | routed experts | shared + dense + routers | embed + head | weights / GPU "
          f"| latent bf16 / token / GPU | latent fp8 / token / GPU | activations / GPU ({a.batched_tokens} tokens) "
          f"| left for the latent cache / GPU | tokens cached, all 8 GPUs (bf16 / fp8 latent) |")
    print("|" + "---|" * 12)
    for name, c in MODELS.items():
        for tp in (True, False):
            parts = plan(c, tp, not tp)
            w = sum(parts)
            lat16, lat8 = latent_bytes_per_token(c, 2), latent_bytes_per_token(c, 1)
            act = activation_bytes_per_token(c, tp) * a.batched_tokens
            left = a.hbm_gib * G * 0.9 - w - act
            layout = "TP8" if tp else "DP8 + EP8"
            note = " (latent replicated on every rank)" if tp else " (own sequences only)"
            ranks = 1 if tp else 8  # TP8: one copy of the latent per rank; DP8: eight disjoint caches
            cached = (f"{ranks * left / lat16 / 1e3:.0f}K / {ranks * left / lat8 / 1e3:.0f}K" if left > 0
                      else "does not fit (needs vocab-parallel embeddings / TP inside DP, or more GPUs)")
            print(f"| {name} | {layout} | {parts[0] / G:.1f} GiB | {parts[1] / G:.1f} GiB | {parts[2] / G:.1f} GiB "
                  f"| {parts[3] / G:.2f} GiB | **{w / G:.1f} GiB** | {lat16 / 1024:.1f} KiB{note} | {lat8 / 1024:.1f} KiB "
                  f"| {act / G:.2f} GiB | {left / G:.1f} GiB | {cached} |")


if __name__ == "__main__":
    main()
