#!/usr/bin/env python3
"""Writes refs_w8a8.json beside the refs.json of each W8A8 quant fixture
(tests/fixtures/quant/{fp8_block, ct_fp8_channel, ct_fp8_tensor, qwen3_moe_fp8_block}): the logits of the checkpoint
computed as W8A8, i.e. with its input activations quantized the way the config says before
every quantized linear, as an independent torch implementation of that rounding:

    fp8 e4m3, dynamic, per token (compressed-tensors strategy "token") or per token and group of
    128 columns (quant_method fp8 with weight_block_size, DeepSeek-V3's activation scheme):
        s = amax(|x|) / 448 over the token (group); s = 1 where amax is 0
        x' = float(clamp(x / s, -448, 448).to(torch.float8_e4m3fn)) * s

The weights are the format's exact fp32 dequantization (fp8 value x scale per block / channel /
tensor, read from the safetensors file, saved as a plain checkpoint that transformers loads), the
rest of the model is transformers' fp32 forward with eager attention: only the activation
rounding differs from refs.json. MoE experts (transformers' stacked Qwen3MoeExperts) get the
rounding on each expert's gathered input rows and on its SiLU*mul output, as atomc's per-expert
matmuls do; the routers stay unquantized (modules_to_not_convert). tests/test_quant_cpu.c
checks the CPU's default (W8A8) forward against these and the weight-only forward against
refs.json. Prompts are refs.json's.

Run (CPU, a few seconds): python3 tools/make_w8a8_refs.py [--dir tests/fixtures/quant]
"""
import argparse
import json
import os

import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

FP8_MAX = 448.0
GROUP = 128
FIXTURES = ("fp8_block", "ct_fp8_channel", "ct_fp8_tensor", "qwen3_moe_fp8_block")


def fake_quant_fp8(x, group):
    """x (..., k) fp32 -> dequantized e4m3 values with one scale per row (group None) or per
    group of `group` columns (the last may be short)."""
    k = x.shape[-1]
    out = torch.empty_like(x)
    g = group or k
    for c0 in range(0, k, g):
        xs = x[..., c0:c0 + g]
        s = xs.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (xs / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        out[..., c0:c0 + g] = q * s
    return out


def exact_weights(path, qc):
    """The fp32 state dict with every quantized linear dequantized exactly, and the set of
    quantized module names."""
    raw = load_file(os.path.join(path, "model.safetensors"))
    sd, quantized = {}, set()
    for k, v in raw.items():
        if k.endswith("weight_scale") or k.endswith("weight_scale_inv"):
            continue
        mod = k[:-len(".weight")] if k.endswith(".weight") else None
        assert v.dtype != torch.float8_e4m3fn or mod, k
        if v.dtype == torch.float8_e4m3fn:
            q = v.float()
            if qc["quant_method"] == "fp8":
                s = raw[mod + ".weight_scale_inv"].float()
                bs = qc["weight_block_size"]
                s = s.repeat_interleave(bs[0], 0).repeat_interleave(bs[1], 1)[:q.shape[0], :q.shape[1]]
            else:
                s = raw[mod + ".weight_scale"].float()
                s = s.reshape(-1, 1) if s.numel() > 1 else s.reshape(1, 1)
            sd[k] = q * s
            quantized.add(mod)
        else:
            sd[k] = v.float()
    return sd, quantized


def experts_forward_w8a8(group):
    """Qwen3MoeExperts.forward with the activation rounding before both expert matmuls."""
    import torch.nn as nn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            x = fake_quant_fp8(hidden_states[tok].float(), group)
            gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = fake_quant_fp8(self.act_fn(gate) * up, group)
            h = nn.functional.linear(h, self.down_proj[e]) * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, h.to(final.dtype))
        return final
    return forward


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant"))
    a = ap.parse_args()
    for name in FIXTURES:
        path = os.path.join(a.dir, name)
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        qc = cfg.pop("quantization_config")
        group = GROUP if qc["quant_method"] == "fp8" else None
        sd, quantized = exact_weights(path, qc)
        plain = tempfile.mkdtemp()
        try:
            with open(os.path.join(plain, "config.json"), "w") as f:
                json.dump(cfg, f)
            save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(plain, "model.safetensors"),
                      metadata={"format": "pt"})
            model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32,
                                                         attn_implementation="eager").float().eval()
        finally:
            shutil.rmtree(plain)
        hooked = 0
        for mname, mod in model.named_modules():
            if mname in quantized:
                mod.register_forward_pre_hook(lambda m, args: (fake_quant_fp8(args[0].float(), group),))
                hooked += 1
            elif type(mod).__name__ == "Qwen3MoeExperts":
                mod.forward = experts_forward_w8a8(group).__get__(mod)
                hooked += sum(1 for q in quantized if q.startswith(mname + "."))
        assert hooked == len(quantized) > 0, (hooked, len(quantized))
        with open(os.path.join(path, "refs.json")) as f:
            refs = json.load(f)
        prompts = []
        for p in refs["prompts"]:
            ids = torch.tensor([p["ids"]])
            with torch.no_grad():
                logits = model(ids).logits[0].float()
            seq, greedy, margins = ids, [], []
            with torch.no_grad():
                for _ in range(len(p["greedy"])):
                    top2 = torch.topk(model(seq).logits[0, -1].float(), 2)
                    greedy.append(int(top2.indices[0]))
                    margins.append(round(float(top2.values[0] - top2.values[1]), 6))
                    seq = torch.cat([seq, top2.indices[:1].view(1, 1)], dim=1)
            prompts.append(dict(ids=p["ids"], logit_positions=p["logit_positions"],
                                logits=[[round(float(x), 5) for x in logits[i]] for i in p["logit_positions"]],
                                greedy=greedy, greedy_margins=margins))
        with open(os.path.join(path, "refs_w8a8.json"), "w") as f:
            json.dump(dict(model=name, generator="tools/make_w8a8_refs.py",
                           reference="transformers fp32 Llama, eager attention, linear weights = the format's exact "
                                     "fp32 dequantization, input activations of every quantized linear fake-quantized "
                                     "to fp8 e4m3 (dynamic, per token%s)" % (" and 128-column group" if group else ""),
                           transformers=__import__("transformers").__version__, prompts=prompts), f,
                      separators=(",", ":"))
            f.write("\n")
        d = max(abs(x - y) for p, q in zip(prompts, refs["prompts"]) for r, s in zip(p["logits"], q["logits"])
                for x, y in zip(r, s))
        print(f"{name}: {hooked} quantized linears hooked; max |W8A8 logit - weight-only logit| = {d:.4f}")


if __name__ == "__main__":
    main()
