#!/usr/bin/env python3
"""Writes tiny random-weight GPT-OSS checkpoints (GptOssForCausalLM) and their HF transformers
reference outputs into tests/fixtures/models/<name>/, in the format of tools/make_tiny_models.py
(config.json, generation_config.json, model.safetensors, refs.json: logits at several positions,
16 greedy tokens with their top-1/top-2 margins) plus the routing-gap fields of
tools/make_tiny_moe_models.py (router_min_gap, router_min_logit_gap, bf16_routing_flips).

Fixtures (hidden 64, head_dim 64, 4 heads / 2 KV heads, 3 layers typed sliding / full / sliding,
sliding_window 8 so the prompts of 19 and 37 tokens and their 16 greedy tokens cross it, YaRN
RoPE with truncate false, 4 experts top-2 of intermediate 64, q/k/v/o biases, sinks, router
and expert biases):
    gpt_oss        bf16 storage, as transformers saves it (experts (E, H, 2I) with gate / up
                   columns interleaved); swiglu_limit 2.0 so the clamps bite on these weights
    gpt_oss_mxfp4  the experts in the MXFP4 layout OpenAI ships (<name>_blocks U8 (E, rows,
                   cols / 32, 16): two e2m1 values per byte, the even column in the low nibble;
                   <name>_scales U8 (E, rows, cols / 32) e8m0 exponents), quantized here from
                   random weights; quantization_config {"quant_method": "mxfp4",
                   "modules_to_not_convert": [...]}; swiglu defaults (alpha 1.702, limit 7.0)
                   left to the config class. Its references come from loading the written
                   file with transformers' Mxfp4Config(dequantize=True), which proves the file.

Routing is made clear of ties by the routing channel of make_tiny_moe_models.py (the last
ROUTE_DIMS hidden dims hold only the token embedding, o_proj / expert down rows and biases for
them are zero), with the router bias included in the clarity check.

Run (CPU, ~1 minute):  python3 tools/make_tiny_gpt_oss.py [--out tests/fixtures/models]
"""
import argparse
import copy
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_models import references  # noqa: E402

VOCAB = 256
ROUTE_DIMS = 8
ROUTER_CONTEXT_SCALE = 0.05
ROUTER_CODE_STD = 3.5
RMS_RANGE = (1.0, 1.5, 2.0, 3.0, 4.0)
MIN_CODE_LOGIT_GAP = 0.5
MIN_CODE_PROB_GAP = 0.06
MIN_ROUTER_GAP = 2e-2
MIN_ROUTER_LOGIT_GAP = 0.25
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def make_config(extra):
    kw = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=64,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=8, attention_bias=True,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                   truncate=False, original_max_position_embeddings=64))
    kw.update(extra)
    cfg = GptOssConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def init_weights(model, gen):
    """Spread-out random weights (as make_tiny_models.init_weights), fan-in taken per tensor."""
    H = model.config.hidden_size
    I = model.config.intermediate_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("experts.gate_up_proj"):  # (E, H, 2I)
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / H ** 0.5))
            elif name.endswith("experts.down_proj"):  # (E, I, H)
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / I ** 0.5))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / p.shape[-1] ** 0.5))


def routers(model):
    return [(layer.mlp.router, layer.post_attention_layernorm.weight) for layer in model.model.layers]


def bf16(t):
    return t.to(torch.bfloat16).float()


def code_is_clear(w_rc, bias, code, k):
    for rms in RMS_RANGE:
        logits = w_rc @ code / rms + bias
        top = torch.topk(logits, k + 1).values
        probs = torch.topk(torch.softmax(logits, -1), k + 1).values
        if float(top[-2] - top[-1]) < MIN_CODE_LOGIT_GAP or float(probs[-2] - probs[-1]) < MIN_CODE_PROB_GAP:
            return False
    return True


def add_routing_channel(model, gen):
    hidden = model.config.hidden_size
    rc = slice(hidden - ROUTE_DIMS, hidden)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[rc, :] = 0
            layer.self_attn.o_proj.bias[rc] = 0
            layer.mlp.experts.down_proj[:, :, rc] = 0
            layer.mlp.experts.down_proj_bias[:, rc] = 0
        for r, _ in routers(model):
            r.weight[:, :hidden - ROUTE_DIMS] *= ROUTER_CONTEXT_SCALE
            r.weight[:, rc] = torch.randn(r.weight[:, rc].shape, generator=gen) * (ROUTER_CODE_STD / ROUTE_DIMS ** 0.5)
            r.bias.mul_(0.1)
        emb = model.model.embed_tokens.weight
        for tok in range(emb.shape[0]):
            for _ in range(100000):
                code = bf16(torch.randn(ROUTE_DIMS, generator=gen))
                if all(code_is_clear(bf16(r.weight[:, rc]), bf16(r.bias), code * bf16(nw[rc]), r.top_k)
                       for r, nw in routers(model)):
                    break
            else:
                raise SystemExit(f"no routing code with clear top-k for token {tok}")
            emb[tok, rc] = code


def router_gaps(model):
    gaps, logit_gaps = [], []

    def hook(mod, inp, out):
        logits = out[0].float()
        probs = torch.softmax(logits, dim=-1)
        k = mod.top_k
        top = torch.topk(probs, k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))
        top = torch.topk(logits, k + 1, dim=-1).values
        logit_gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    return gaps, logit_gaps, [r.register_forward_hook(hook) for r, _ in routers(model)]


def routing_of(model, seqs):
    got = []

    def hook(mod, inp, out):
        got.append(torch.sort(out[2], -1).values)

    handles = [r.register_forward_hook(hook) for r, _ in routers(model)]
    with torch.no_grad():
        for s in seqs:
            model(torch.tensor([s]))
    for h in handles:
        h.remove()
    return got


def bf16_routing_flips(model, refs):
    seqs = [p["ids"] + p["greedy"] for p in refs]
    ref = routing_of(model, seqs)
    got = routing_of(copy.deepcopy(model).to(torch.bfloat16), seqs)
    return sum(int((a != b).any(-1).sum()) for a, b in zip(ref, got))


def mxfp4_quantize(w):
    """w (..., rows, cols) fp32 -> (blocks U8 (..., rows, cols/32, 16), scales U8 (..., rows, cols/32)):
    per 32 values the smallest power-of-two scale 2^s with max|w| / 2^s <= 6, values rounded to
    the nearest e2m1 (ties to the even code)."""
    *pre, rows, cols = w.shape
    g = w.reshape(*pre, rows, cols // 32, 32).double()
    amax = g.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    q = g / torch.pow(2.0, s)
    lut = torch.tensor(E2M1[:8], dtype=torch.float64)
    idx = (q.abs().unsqueeze(-1) - lut).abs().argmin(-1)  # nearest magnitude (lower index on ties)
    codes = (idx + torch.where(q < 0, 8, 0)).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (s[..., 0] + 127).to(torch.uint8).contiguous()


def save_refs(d, name, model, refs, gaps, logit_gaps, flips, storage, extra=None):
    doc = dict(model=name, storage_dtype=storage, generator="tools/make_tiny_gpt_oss.py",
               transformers=__import__("transformers").__version__, router_min_gap=min(gaps),
               router_min_logit_gap=min(logit_gaps), bf16_routing_flips=flips, prompts=refs)
    doc.update(extra or {})
    with open(os.path.join(d, "refs.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    mins = min(min(p["greedy_margins"]) for p in refs)
    scale = max(max(abs(x) for row in p["logits"] for x in row) for p in refs)
    print(f"{name}: max|logit|={scale:.2f} min greedy margin={mins:.4f} router min gap={min(gaps):.4f} "
          f"(logits {min(logit_gaps):.3f}), bf16 flips {flips}")


def build(name, extra, seed, out, mxfp4):
    for attempt in range(20):
        gen = torch.Generator().manual_seed(seed + attempt)
        cfg = make_config(extra)
        model = GptOssForCausalLM(cfg).eval()
        init_weights(model, gen)
        add_routing_channel(model, gen)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(bf16(p))
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        model.generation_config.do_sample = False
        model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
        # The references come from the written file loaded back by transformers (fp32): the
        # in-memory model's buffers (RoPE inv_freq) went through BF16 with .to() above.
        qc = None
        if mxfp4:
            # Replace the experts by their MXFP4 blocks / scales (rows = output features, as
            # OpenAI stores them: gate_up_proj (E, H, 2I) -> (E, 2I, H) rows), then load the file
            # back through transformers' own dequantization for the references.
            path = os.path.join(d, "model.safetensors")
            sd = load_file(path)
            for key in list(sd):
                if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
                    w = sd.pop(key).float().transpose(1, 2).contiguous()
                    sd[key + "_blocks"], sd[key + "_scales"] = mxfp4_quantize(w)
            save_file(sd, path, metadata={"format": "pt"})
            with open(os.path.join(d, "config.json")) as f:
                cj = json.load(f)
            cj["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cj, f, indent=2)
            qc = Mxfp4Config(dequantize=True)
        model = GptOssForCausalLM.from_pretrained(d, quantization_config=qc, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        gaps, logit_gaps, handles = router_gaps(model)
        refs = references(model, gen)
        for h in handles:
            h.remove()
        flips = bf16_routing_flips(model, refs)
        print(f"{name} seed attempt {attempt}: router min gap {min(gaps):.4f} (logits {min(logit_gaps):.3f}), "
              f"{flips} BF16 routing flips")
        if min(gaps) >= MIN_ROUTER_GAP and min(logit_gaps) >= MIN_ROUTER_LOGIT_GAP and flips == 0:
            break
    else:
        raise SystemExit(f"{name}: no seed gives routing clear of BF16 noise")
    # The config as written (transformers 5 rope_parameters; quantization_config for MXFP4).
    save_refs(d, name, model, refs, gaps, logit_gaps, flips, "mxfp4" if mxfp4 else "bfloat16",
              dict(swiglu_limit=model.config.swiglu_limit, swiglu_alpha=model.config.swiglu_alpha))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    args = ap.parse_args()
    torch.manual_seed(0)
    build("gpt_oss", dict(swiglu_limit=2.0), 9100, args.out, False)
    build("gpt_oss_mxfp4", {}, 9200, args.out, True)


if __name__ == "__main__":
    main()
