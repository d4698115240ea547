#!/usr/bin/env python3
"""Writes tests/fixtures/quant/deepseek_v3_fp8_block: the tiny DeepSeek-V3 fixture
(tests/fixtures/models/deepseek_v3, tools/make_tiny_deepseek.py: q_lora, grouped noaux_tc routing,
one shared expert) as DeepSeek-V3 / R1 ship it: quant_method "fp8", weight_block_size [128, 128],
activation_scheme dynamic, every linear of the decoder layers (q_a / q_b / kv_a / kv_b / o
projections, routed and shared experts) stored as F8_E4M3 with an F32 weight_scale_inv per
128x128 block (partial blocks where a dim is below 128: rows of 256 span two blocks), the routers,
norms, embeddings and lm_head as stored. modules_to_not_convert lists lm_head and layer 0's dense
MLP (stored BF16, no scales), so that the ignore list is exercised.

Files: config.json, model.safetensors, refs.json, refs_w8a8.json.
- refs.json: transformers' fp32 forward (eager attention) with every quantized weight set to the
  format's exact fp32 dequantization (fp8 value x block scale), activations unquantized: what atomc's
  weight-only run computes. The same file loaded by transformers' own fp8 loader with
  FineGrainedFP8Config(dequantize=True) is checked to give the same logits (up to its bf16
  dequantization), which proves the file is in the format transformers reads.
- refs_w8a8.json: the same forward with the input activations of every quantized linear except
  kv_b_proj fake-quantized the way quant_method fp8 states (dynamic e4m3, one scale per token and
  128-column group; tools/make_w8a8_refs.py's rounding), experts per gathered token rows and on
  their SiLU * up output. kv_b_proj is left out: atomc dequantizes it at load for the absorbed MLA
  (W_UK folded into the query, W_UV applied after attention), so its input, the normed latent, is
  never quantized.

Prompts: lengths 1, 7 and 13 (seeded), 4 greedy tokens each; refs record the routers' smallest
selection gap on the references' inputs (in the units make_tiny_deepseek.py uses).

Run (CPU, ~10 s): python3 tools/make_tiny_deepseek_fp8.py [--out tests/fixtures/quant]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_quant_fixtures import BLOCK, check_close, fp8_block_dequant, fp8_blocks  # noqa: E402
from make_tiny_deepseek import select  # noqa: E402
from make_w8a8_refs import experts_forward_w8a8, fake_quant_fp8  # noqa: E402

NAME = "deepseek_v3_fp8_block"
LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NOT_CONVERTED = ["lm_head", "model.layers.0.mlp"]
LENGTHS = (1, 7, 13)
GREEDY = 4


def quantized_name(k):
    return k.endswith(".weight") and any(k.endswith(f".{n}.weight") for n in LINEARS) and \
        not k.startswith("model.layers.0.mlp.")


def load_plain(sd, cfg):
    d = tempfile.mkdtemp()
    try:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").float().eval()
    finally:
        shutil.rmtree(d)


def router_gap(model, seqs):
    gaps = []

    def hook(mod, inp, out):
        gaps.append(select(mod, out[0].float())[1])
    hs = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        for s in seqs:
            model(s)
    for h in hs:
        h.remove()
    return min(gaps)


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
                        logits=[[round(float(x), 5) for x in logits[p]] for p in positions], greedy=greedy,
                        greedy_margins=margins))
    return out


def write(path, reference, prompts, gap):
    with open(path, "w") as f:
        json.dump(dict(model=NAME, generator="tools/make_tiny_deepseek_fp8.py", reference=reference,
                       router_min_gap=round(gap, 6), transformers=__import__("transformers").__version__,
                       prompts=prompts), f, separators=(",", ":"))
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--src", default=os.path.join(here, "..", "tests", "fixtures", "models", "deepseek_v3"))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "quant"))
    a = ap.parse_args()
    out = os.path.join(a.out, NAME)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(a.src, "config.json")) as f:
        cfg = json.load(f)
    sd = load_file(os.path.join(a.src, "model.safetensors"))
    tensors, exact, quantized = {}, {}, set()
    for k, v in sd.items():
        if quantized_name(k):
            q, s = fp8_blocks(v.float())
            tensors[k] = q
            tensors[k[:-len("weight")] + "weight_scale_inv"] = s
            exact[k] = fp8_block_dequant(q, s)
            quantized.add(k[:-len(".weight")])
        else:
            tensors[k] = v.contiguous()
            exact[k] = v.float()
    multi = [k for k in quantized if tensors[k + ".weight_scale_inv"].numel() > 1]
    assert any("kv_b_proj" in k for k in multi), "kv_b_proj must span several blocks"
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    qcfg = dict(cfg, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [BLOCK, BLOCK],
                                          "modules_to_not_convert": NOT_CONVERTED})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(qcfg, f, indent=2, sort_keys=True)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(a.src, extra)):
            shutil.copy(os.path.join(a.src, extra), os.path.join(out, extra))

    ref = load_plain(exact, cfg)
    gen = torch.Generator().manual_seed(2026)
    prompts = [torch.randint(4, cfg["vocab_size"], (1, n), generator=gen) for n in LENGTHS]
    # The file as transformers' fp8 loader reads it gives the same model.
    fp8 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=FineGrainedFP8Config(
                                                   weight_block_size=(BLOCK, BLOCK), dequantize=True)).float().eval()
    with torch.no_grad():
        for ids in prompts:
            check_close(f"{NAME} logits (transformers fp8 loader vs exact), len {ids.shape[1]}",
                        fp8(ids).logits.float(), ref(ids).logits.float(), 2 ** -5)
    del fp8
    wonly = refs(ref, prompts)
    gap = router_gap(ref, prompts)
    write(os.path.join(out, "refs.json"),
          "transformers fp32 DeepseekV3ForCausalLM, eager attention, quantized weights = the fp8 blocks' exact fp32 "
          "dequantization, activations unquantized", wonly, gap)

    hooked = 0
    for mname, mod in ref.named_modules():
        if mname in quantized and not mname.endswith("kv_b_proj"):
            mod.register_forward_pre_hook(lambda m, args: (fake_quant_fp8(args[0].float(), 128),))
            hooked += 1
        elif type(mod).__name__ == "DeepseekV3Experts":
            mod.forward = experts_forward_w8a8(128).__get__(mod)
            hooked += sum(1 for q in quantized if q.startswith(mname + "."))
    n_kv_b = sum(1 for q in quantized if q.endswith("kv_b_proj"))
    assert hooked == len(quantized) - n_kv_b > 0, (hooked, len(quantized))
    w8a8 = refs(ref, prompts)
    gap8 = router_gap(ref, prompts)
    write(os.path.join(out, "refs_w8a8.json"),
          "as refs.json, with the input activations of every quantized linear but kv_b_proj fake-quantized to fp8 "
          "e4m3 (dynamic, per token and 128-column group)", w8a8, gap8)
    d = max(abs(x - y) for p, q in zip(w8a8, wonly) for r, s in zip(p["logits"], q["logits"]) for x, y in zip(r, s))
    print(f"{NAME}: {len(quantized)} quantized linears ({hooked} activation-quantized); router min gap "
          f"{gap:.4f} / {gap8:.4f} (w8a8); max |W8A8 - weight-only logit| = {d:.4f}")


if __name__ == "__main__":
    main()
