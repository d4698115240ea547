#!/usr/bin/env python3
"""Writes tiny random-weight Qwen3-Next and Qwen3.5-MoE (text) HF checkpoints and their HF
transformers reference outputs into tests/fixtures/models/<name>/, in the format of
tools/make_tiny_models.py: config.json, generation_config.json, model.safetensors (bf16 storage,
per-expert tensors as transformers saves them) and refs.json (fp32 logits at several positions of
each prompt, 16 greedy tokens with their top-1/top-2 margins, full recompute per step).

Both have hybrid layers (Gated DeltaNet linear attention and gated full attention, alternating),
partial rotary (0.25 of head_dim 64), zero-centred RMSNorm weights ((1 + w), drawn around 0 here
so the offset matters), MoE with 8 experts top-2 plus a sigmoid-gated shared expert:
    qwen3_next     Qwen3NextForCausalLM: fused in_proj_qkvz / in_proj_ba (grouped per key head),
                   layer 2 a dense MLP (mlp_only_layers)
    qwen3_5_moe    Qwen3_5MoeForCausalLM: split in_proj_qkv / in_proj_z / in_proj_b / in_proj_a,
                   every layer MoE, no intermediate_size in its config
Prompt lengths 1, 6, 37 and 130 (130 crosses two 64-token chunks of the chunked delta rule).

refs_dense.json holds, for BF16 backends, HF's fp32 logits at every DENSE_STRIDE-th position (and the
last) of each prompt, and the max |logit| difference of HF's own BF16 run at each of them. Many
tokens of these random routers sit near a top-k tie (the 2nd and 3rd router logits within 0.05 on
13-30% of the tokens), so any BF16 run picks another expert somewhere and moves a few positions by
more than the BF16 tolerance (HF's BF16 run: 1.7 and 2.1 at two positions of qwen3_5_moe). A BF16
backend is therefore held to the bulk of the positions and to HF-BF16's own outlier rate
(tests/gpu/test_cuda_deltanet.c), not to every position.

Run (CPU, under a minute):  python3 tools/make_tiny_qwen3_next.py [--out tests/fixtures/models]
"""
import argparse
import copy
import json
import os

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

VOCAB = 256
GREEDY_TOKENS = 16
DENSE_STRIDE = 2
PROMPT_LENGTHS = [1, 6, 37, 130]

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
              head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
              linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, layer_types=["linear_attention", "full_attention",
                                                               "linear_attention", "full_attention"],
              bos_token_id=None, eos_token_id=3, pad_token_id=None)

MODELS = {
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM,
                   dict(intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.25})),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM,
                    dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True})),
}


def init_weights(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain weight
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):  # zero-centred: scale (1 + w)
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 4.0, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in ** 0.5))


def references(model, gen):
    prompts = []
    for n in PROMPT_LENGTHS:
        ids = torch.randint(4, VOCAB, (1, n), generator=gen)
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0].float()
        positions = sorted(set([0, n // 3, n // 2, n - 1]))
        seq = ids
        greedy, margins = [], []
        with torch.no_grad():
            for _ in range(GREEDY_TOKENS):
                last = model(seq, use_cache=False).logits[0, -1].float()
                top2 = torch.topk(last, 2)
                greedy.append(int(top2.indices[0]))
                margins.append(float(top2.values[0] - top2.values[1]))
                seq = torch.cat([seq, top2.indices[:1].view(1, 1)], dim=1)
        prompts.append(dict(ids=ids[0].tolist(), logit_positions=positions,
                            logits=[[round(float(x), 6) for x in logits[p]] for p in positions],
                            greedy=greedy, greedy_margins=[round(m, 6) for m in margins]))
    return prompts


def dense_references(model, prompts):
    """HF fp32 logits at every DENSE_STRIDE-th position and the last, and HF BF16's max |diff| there."""
    bf = copy.deepcopy(model).to(torch.bfloat16)
    out = []
    for p in prompts:
        ids = torch.tensor([p["ids"]])
        n = ids.shape[1]
        pos = sorted(set(list(range(0, n, DENSE_STRIDE)) + [n - 1]))
        with torch.no_grad():
            ref = model(ids, use_cache=False).logits[0].float()
            low = bf(ids, use_cache=False).logits[0].float()
        out.append(dict(ids=p["ids"], positions=pos, logits=[[round(float(x), 4) for x in ref[q]] for q in pos],
                        bf16_err=[round(float((low[q] - ref[q]).abs().max()), 4) for q in pos]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    args = ap.parse_args()
    torch.manual_seed(0)
    for i, (name, (cfg_cls, model_cls, overrides)) in enumerate(MODELS.items()):
        kw = dict(COMMON)
        kw.update(overrides)
        cfg = cfg_cls(**kw)
        cfg._attn_implementation = "eager"
        gen = torch.Generator().manual_seed(777 + 100 * i)
        model = model_cls(cfg).eval()
        init_weights(model, gen)
        with torch.no_grad():  # bf16 storage: round first so the fp32 references are exact for it
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        refs = references(model, gen)
        dense = dense_references(model, refs)  # before the in-place bf16 cast below
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "refs_dense.json"), "w") as f:
            json.dump(dict(model=name, generator="tools/make_tiny_qwen3_next.py", stride=DENSE_STRIDE, prompts=dense),
                      f, separators=(",", ":"))
            f.write("\n")
        model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
        with open(os.path.join(d, "refs.json"), "w") as f:
            json.dump(dict(model=name, storage_dtype="bfloat16", generator="tools/make_tiny_qwen3_next.py",
                           transformers=__import__("transformers").__version__, prompts=refs), f,
                      separators=(",", ":"))
            f.write("\n")
        mins = min(min(p["greedy_margins"]) for p in refs)
        scale = max(max(abs(x) for row in p["logits"] for x in row) for p in refs)
        print(f"{name}: max|logit|={scale:.2f} min greedy margin={mins:.4f}")


if __name__ == "__main__":
    main()
