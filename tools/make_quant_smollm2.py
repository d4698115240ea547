#!/usr/bin/env python3
"""Quantized copies of SmolLM2-135M for the perplexity deltas of docs/perf.md (issue 19): the GGUF
(scripts/fetch_model.sh; Q4_1) dequantized by transformers to fp32 is the base, written as

    OUT/base/        F32 safetensors (+ tokenizer), unquantized
    OUT/fp8_block/   quant_method fp8, 128x128 blocks (tools/make_quant_fixtures.py's fp8_blocks; the
                     fused qkv parts (576, 192, 192 rows) are not whole blocks, so atomc regrids them)
    OUT/w4a16_g64/   compressed-tensors pack-quantized INT4, group 64 (576 inputs are not whole
                     128-groups), written by the compressed-tensors package
    OUT/w8a16_g64/   the same with INT8

then run `atomc eval perplexity` on each (tests/fixtures/eval/declaration.txt by default) and print
the table. Nothing here is a test fixture (the copies are 0.1-0.5 GB): run it by hand.

usage: tools/make_quant_smollm2.py GGUF OUT [--text FILE] [--atomc build/atomc] [--ctx 256]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_quant_fixtures import BLOCK, fp8_blocks, is_linear, patch_config  # noqa: E402


def save_dir(model, tok, out):
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)


def make_fp8(model, tok, out):
    save_dir(model, tok, out)
    tensors = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        v = v.contiguous()
        if is_linear(k):
            q, s = fp8_blocks(v.float())
            tensors[k] = q
            tensors[k[:-len("weight")] + "weight_scale_inv"] = s
        else:
            tensors[k] = v
    for f in os.listdir(out):
        if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(out, f))
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    patch_config(out, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                           "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]})


def make_ct_int(model, tok, out, bits, group):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", strategy="group", group_size=group, symmetric=True, dynamic=False))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for _, m in model.named_modules():
            if not hasattr(m, "weight_scale"):
                continue
            args = m.quantization_scheme.weights
            w = m.weight.float().reshape(m.weight.shape[0], -1, args.group_size)
            s, _ = calculate_qparams(w.amin(-1), w.amax(-1), args)
            m.weight_scale.copy_(s.reshape(m.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    save_dir(model, tok, out)
    compressor.update_config(out)


def perplexity(atomc, model, text, ctx):
    out = subprocess.run([atomc, "eval", "perplexity", "--model", model, "--file", text, "--ctx", str(ctx), "--json"],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{model}: {out.stderr}")
    r = json.loads(out.stdout)
    m = re.search(r"weights: ([0-9.]+) MiB", out.stderr)
    return r, float(m.group(1)) if m else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--text", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "eval",
                                                   "declaration.txt"))
    ap.add_argument("--atomc", default="build/atomc")
    ap.add_argument("--ctx", type=int, default=256)
    a = ap.parse_args()
    d, f = os.path.split(os.path.abspath(a.gguf))

    def load():  # the GGUF dequantized to fp32, as a plain (serializable) model
        m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        m.hf_quantizer = None
        if hasattr(m.config, "quantization_config"):
            del m.config.quantization_config
        return m

    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    jobs = {"base": lambda o: save_dir(load(), tok, o), "fp8_block": lambda o: make_fp8(load(), tok, o),
            "w4a16_g64": lambda o: make_ct_int(load(), tok, o, 4, 64),
            "w8a16_g64": lambda o: make_ct_int(load(), tok, o, 8, 64)}
    rows = []
    for name, fn in jobs.items():
        out = os.path.join(a.out, name)
        shutil.rmtree(out, ignore_errors=True)
        fn(out)
        r, mib = perplexity(a.atomc, out, a.text, a.ctx)
        rows.append((name, r, mib))
        print(f"{name:10s} ppl {r['perplexity']:.4f}  ({r.get('tokens_scored', r.get('n_scored', '?'))} tokens, "
              f"weights {mib:.1f} MiB)", flush=True)
    base = rows[0][1]["perplexity"]
    for name, r, mib in rows:
        print(f"| {name} | {r['perplexity']:.4f} | {100 * (r['perplexity'] / base - 1):+.2f}% | {mib:.1f} MiB |")


if __name__ == "__main__":
    main()
