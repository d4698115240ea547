#!/usr/bin/env python3
"""Reference perplexity for `atomc eval perplexity`, computed by HF transformers the way its
documentation describes (sliding windows of --ctx tokens moved by --stride; each window scores
only the tokens not scored by the previous one; the first token of the text is never scored).
The model is SmolLM2-135M-Instruct loaded from its GGUF (transformers dequantizes it to fp32),
the text is tokenized without special tokens (as `atomc eval perplexity` does).

usage: tools/gen_ppl_ref.py GGUF TEXT --ctx N --stride S > tests/fixtures/eval/ppl_ref.json
"""
import argparse
import json
import math
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("text")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--stride", type=int, default=128)
    a = ap.parse_args()
    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).eval()
    text = open(a.text, encoding="utf-8").read()
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    n = ids.size(1)
    nll_sum, n_scored, prev_end = 0.0, 0, 0
    windows = []
    for begin in range(0, n, a.stride):
        end = min(begin + a.ctx, n)
        trg_len = end - prev_end
        x = ids[:, begin:end]
        with torch.no_grad():
            logits = model(x).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        # token at position p (absolute) is predicted by row p-1 of this window
        first = max(end - trg_len, begin + 1)
        s = 0.0
        for p in range(first, end):
            s -= logp[p - begin - 1, ids[0, p]].item()
        nll_sum += s
        n_scored += end - first
        windows.append({"begin": begin, "end": end, "scored": end - first, "nll": s})
        prev_end = end
        if end == n:
            break
    print(json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "text": os.path.basename(a.text), "ctx": a.ctx,
                      "stride": a.stride, "n_tokens": n, "n_scored": n_scored, "nll": nll_sum,
                      "perplexity": math.exp(nll_sum / n_scored), "windows": windows,
                      "first_ids": ids[0, :32].tolist()}, indent=1))


if __name__ == "__main__":
    main()
