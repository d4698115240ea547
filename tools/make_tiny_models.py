#!/usr/bin/env python3
"""Writes tiny random-weight HF checkpoints of every dense architecture atomc supports, plus
reference outputs computed by HF transformers (fp32, eager attention), into
tests/fixtures/models/<name>/:

    config.json, generation_config.json, model.safetensors   (the checkpoint)
    refs.json                                                 (what tests/test_models.c checks)

refs.json holds, per prompt (random token ids of several lengths):
    ids               the prompt
    logit_positions   prompt positions whose logits are stored
    logits            (len(logit_positions), vocab) fp32 logits of the full-prompt forward
    greedy            16 greedy tokens continuing the prompt (HF generate, do_sample=False)
    greedy_margins    top1 - top2 logit gap at each greedy step (tests only demand equality
                      where this gap is clearly above fp32 noise)

The weights are drawn with a larger std than HF's default so that logits are spread out
(clear top-2 margins) rather than all near zero. Checkpoints stored in BF16 / F16 are rounded
to that dtype *before* the references are computed, so the references are exact for them.

Run (CPU, ~1 minute):  python3 tools/make_tiny_models.py [--out tests/fixtures/models]
Needs torch + transformers (tests/requirements.txt lists them as test-only tools).
"""
import argparse
import json
import os

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

VOCAB = 256
GREEDY_TOKENS = 16
PROMPT_LENGTHS = [1, 6, 19, 37]

# head_dim 64 (128 for qwen3): the sizes the CUDA attention kernels are built for, so the same
# fixtures serve the GPU tests; hidden 64 keeps every matrix small.
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, head_dim=64,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# name -> (config class, model class, config overrides, storage dtype, write classic rope keys)
MODELS = {
    "llama_gqa": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=10000.0), torch.float32, False),
    "llama_mha": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, num_hidden_layers=2,
                                                      rope_theta=500000.0), torch.bfloat16, True),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True, num_key_value_heads=1),
                   torch.float16, False),
    "llama_rope_llama3": (LlamaConfig, LlamaForCausalLM,
                          dict(rope_theta=500000.0, max_position_embeddings=2048,
                               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0, original_max_position_embeddings=256)),
                          torch.bfloat16, True),
    "llama_rope_linear": (LlamaConfig, LlamaForCausalLM,
                          dict(rope_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=4.0),
                               num_hidden_layers=2), torch.bfloat16, False),
    "llama_bias": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True, rope_theta=10000.0,
                                                       num_hidden_layers=2), torch.bfloat16, False),
    # Mistral = Llama + sliding-window attention: prompts up to 37 + 16 tokens cross the window of 8.
    "mistral_sliding": (MistralConfig, MistralForCausalLM, dict(rope_theta=10000.0, num_hidden_layers=2,
                                                                sliding_window=8), torch.bfloat16, False),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM,
              dict(head_dim=128, rope_theta=1000000.0, num_hidden_layers=2, max_window_layers=2,
                   use_sliding_window=False, bos_token_id=None, eos_token_id=3),
              torch.bfloat16, False),
    "qwen3_yarn": (Qwen3Config, Qwen3ForCausalLM,
                   dict(head_dim=64, rope_theta=10000.0, num_hidden_layers=2, max_window_layers=2,
                        use_sliding_window=False, bos_token_id=None, eos_token_id=3, max_position_embeddings=128,
                        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
                   torch.bfloat16, False),
}


def make_config(cfg_cls, overrides):
    kw = dict(BASE)
    kw.update(overrides)
    rope_theta = kw.pop("rope_theta", 10000.0)
    scaling = kw.pop("rope_scaling", None)
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if scaling:
        rope.update(scaling)
        rope["rope_theta"] = rope_theta
    kw["rope_parameters"] = rope
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def init_weights(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in ** 0.5))


def classic_rope_keys(path):
    """Rewrites config.json's transformers-5 `rope_parameters` into the classic
    `rope_theta` + `rope_scaling` keys (older checkpoints look like this)."""
    with open(path) as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rp
    else:
        cfg["rope_scaling"] = None
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def references(model, gen):
    prompts = []
    for n in PROMPT_LENGTHS:
        ids = torch.randint(4, VOCAB, (1, n), generator=gen)
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        positions = sorted(set([0, n // 3, n // 2, n - 1]))
        # Plain greedy loop with a full recompute per step (no KV cache, no EOS handling, no
        # logits processors): the reference is the argmax of the raw logits.
        seq = ids
        greedy, margins = [], []
        with torch.no_grad():
            for _ in range(GREEDY_TOKENS):
                last = model(seq).logits[0, -1].float()
                top2 = torch.topk(last, 2)
                greedy.append(int(top2.indices[0]))
                margins.append(float(top2.values[0] - top2.values[1]))
                seq = torch.cat([seq, top2.indices[:1].view(1, 1)], dim=1)
        prompts.append(dict(ids=ids[0].tolist(), logit_positions=positions,
                            logits=[[round(float(x), 6) for x in logits[p]] for p in positions],
                            greedy=greedy, greedy_margins=[round(m, 6) for m in margins]))
    return prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    args = ap.parse_args()
    torch.manual_seed(0)
    for i, (name, (cfg_cls, model_cls, overrides, dtype, classic)) in enumerate(MODELS.items()):
        gen = torch.Generator().manual_seed(1234 + i)
        cfg = make_config(cfg_cls, overrides)
        model = model_cls(cfg).eval()
        init_weights(model, gen)
        if dtype != torch.float32:
            # Round to the storage dtype so the fp32 references describe the stored weights exactly.
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(dtype).float())
        model.generation_config.do_sample = False
        refs = references(model, gen)
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        model.to(dtype).save_pretrained(d, safe_serialization=True)
        if classic:
            classic_rope_keys(os.path.join(d, "config.json"))
        with open(os.path.join(d, "refs.json"), "w") as f:
            json.dump(dict(model=name, storage_dtype=str(dtype).replace("torch.", ""),
                           generator="tools/make_tiny_models.py", transformers=__import__("transformers").__version__,
                           prompts=refs), f, separators=(",", ":"))
            f.write("\n")
        mins = min(min(p["greedy_margins"]) for p in refs)
        scale = max(max(abs(x) for row in p["logits"] for x in row) for p in refs)
        print(f"{name}: dtype={dtype} max|logit|={scale:.2f} min greedy margin={mins:.4f}")


if __name__ == "__main__":
    main()
