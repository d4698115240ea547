#!/usr/bin/env python3
"""Writes a random-weight HF checkpoint (model.safetensors shards + index, config.json) for a
config.json alone, with the tensor names and shapes transformers would produce. Used on the
GPU machine to measure start-up from a real safetensors file of a real size (e.g. Llama-3-8B:
16 GB in bf16) without downloading weights. Weights are N(0, 0.02) (norms 1.0); generated on
the GPU when one is available, so writing is bounded by the disk.

usage: tools/write_random_checkpoint.py CONFIG_DIR OUT_DIR [--dtype bfloat16] [--shard-gb 5]
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file


def tensor_specs(c):
    h, L = c["hidden_size"], c["num_hidden_layers"]
    nh, nkv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or h // nh
    inter, vocab = c["intermediate_size"], c["vocab_size"]
    arch = c["architectures"][0]
    yield "model.embed_tokens.weight", (vocab, h)
    for l in range(L):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (nh * hd, h)
        yield p + "self_attn.k_proj.weight", (nkv * hd, h)
        yield p + "self_attn.v_proj.weight", (nkv * hd, h)
        yield p + "self_attn.o_proj.weight", (h, nh * hd)
        if c.get("attention_bias"):
            yield p + "self_attn.q_proj.bias", (nh * hd,)
            yield p + "self_attn.k_proj.bias", (nkv * hd,)
            yield p + "self_attn.v_proj.bias", (nkv * hd,)
        if arch.startswith("Qwen3"):
            yield p + "self_attn.q_norm.weight", (hd,)
            yield p + "self_attn.k_norm.weight", (hd,)
        ne = c.get("num_experts") or c.get("num_local_experts") or 0
        if ne:
            mi = c.get("moe_intermediate_size") or inter
            yield p + "mlp.gate.weight", (ne, h)
            for e in range(ne):
                yield p + f"mlp.experts.{e}.gate_proj.weight", (mi, h)
                yield p + f"mlp.experts.{e}.up_proj.weight", (mi, h)
                yield p + f"mlp.experts.{e}.down_proj.weight", (h, mi)
        else:
            yield p + "mlp.gate_proj.weight", (inter, h)
            yield p + "mlp.up_proj.weight", (inter, h)
            yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not c.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.config_dir, "config.json")))
    os.makedirs(a.out_dir, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(a.config_dir, f)):
            shutil.copy(os.path.join(a.config_dir, f), os.path.join(a.out_dir, f))
    dtype = getattr(torch, a.dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    limit = int(a.shard_gb * 2**30)
    shards, cur, cur_bytes = [], {}, 0
    for name, shape in tensor_specs(cfg):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype, device=dev)
        else:
            t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(dtype)
        cur[name] = t.cpu()
        cur_bytes += t.numel() * t.element_size()
        if cur_bytes >= limit:
            shards.append(cur)
            cur, cur_bytes = {}, 0
    if cur:
        shards.append(cur)
    weight_map, total = {}, 0
    for i, s in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        save_file(s, os.path.join(a.out_dir, fn), metadata={"format": "pt"})
        for k, v in s.items():
            weight_map[k] = fn
            total += v.numel() * v.element_size()
    if len(shards) > 1:
        with open(os.path.join(a.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    print(f"wrote {len(weight_map)} tensors, {total / 2**30:.2f} GiB in {len(shards)} file(s) to {a.out_dir}")


if __name__ == "__main__":
    main()
