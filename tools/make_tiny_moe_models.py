#!/usr/bin/env python3
"""Writes tiny random-weight mixture-of-experts HF checkpoints (Qwen3-MoE, Mixtral) and their
HF transformers reference outputs into tests/fixtures/models/<name>/, in the same format as
tools/make_tiny_models.py (whose helpers it reuses): config.json, generation_config.json,
model.safetensors (per-expert tensors, as transformers saves them) and refs.json (logits at
several positions, 16 greedy tokens with their top-1/top-2 margins).

Extra in refs.json: `router_min_gap`, the smallest gap (over every token of every prompt and
every MoE layer, full-prompt forwards) between the k-th and (k+1)-th routing probability.
Exact ties would make the expert choice depend on tie-breaking (torch.topk leaves tie order
unspecified; atomc takes the lower expert id), so the script reports the gap to show the
fixtures do not sit on a tie.

Fixtures (head_dim 64 so the CUDA attention runs them too; bf16 storage, fp32 references):
    qwen3_moe          8 experts top-4, norm_topk_prob, decoder_sparse_step 1, layer 1 mlp_only
    qwen3_moe_sparse2  8 experts top-2, no norm_topk_prob, decoder_sparse_step 2 (layer 1 MoE only)
    mixtral            4 experts top-2 (always renormalised), sliding_window 16 (prompts cross it)

Run (CPU, ~1 minute):  python3 tools/make_tiny_moe_models.py [--out tests/fixtures/models]
"""
import argparse
import json
import os
import sys

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_models import init_weights, make_config, references  # noqa: E402

MODELS = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=1000000.0, use_sliding_window=False,
                       max_window_layers=3, bos_token_id=None, eos_token_id=3)),
    "qwen3_moe_sparse2": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
                               decoder_sparse_step=2, mlp_only_layers=[], rope_theta=10000.0,
                               use_sliding_window=False, max_window_layers=3, bos_token_id=None, eos_token_id=3)),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, sliding_window=16,
                     num_hidden_layers=2, rope_theta=1000000.0)),
}


MIN_ROUTER_GAP = 2e-4


def router_gaps(model):
    """Registers hooks on every router; returns a list that collects the k-th/(k+1)-th gaps."""
    gaps = []

    def hook(mod, inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        probs = torch.softmax(logits.float(), dim=-1)
        k = mod.top_k
        if k < probs.shape[-1]:
            top = torch.topk(probs, k + 1, dim=-1).values
            gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    for name, mod in model.named_modules():
        if name.endswith("mlp.gate") or name.endswith("block_sparse_moe.gate"):
            mod.register_forward_hook(hook)
    return gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    args = ap.parse_args()
    torch.manual_seed(0)
    for i, (name, (cfg_cls, model_cls, overrides)) in enumerate(MODELS.items()):
        # Seeds are tried in order until every routing decision of the references is clear of a
        # tie by MIN_ROUTER_GAP (fp32 summation-order noise in the probabilities is ~1e-7).
        for attempt in range(50):
            gen = torch.Generator().manual_seed(4321 + 100 * i + attempt)
            cfg = make_config(cfg_cls, overrides)
            model = model_cls(cfg).eval()
            init_weights(model, gen)
            with torch.no_grad():  # bf16 storage: round first so the fp32 references are exact for it
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
            gaps = router_gaps(model)
            refs = references(model, gen)
            if not gaps or min(gaps) >= MIN_ROUTER_GAP:
                break
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
        with open(os.path.join(d, "refs.json"), "w") as f:
            json.dump(dict(model=name, storage_dtype="bfloat16", generator="tools/make_tiny_moe_models.py",
                           transformers=__import__("transformers").__version__,
                           router_min_gap=min(gaps) if gaps else None, prompts=refs), f, separators=(",", ":"))
            f.write("\n")
        mins = min(min(p["greedy_margins"]) for p in refs)
        scale = max(max(abs(x) for row in p["logits"] for x in row) for p in refs)
        print(f"{name}: max|logit|={scale:.2f} min greedy margin={mins:.4f} "
              f"router min k/k+1 gap={min(gaps) if gaps else 'n/a'}")


if __name__ == "__main__":
    main()
