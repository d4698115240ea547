#!/usr/bin/env python3
"""Reference greedy continuations of SmolLM2-135M-Instruct (GGUF Q4_1) by HF transformers,
for tests/test_smollm2.c.

transformers loads the GGUF with `gguf_file=` and dequantizes every tensor to fp32, exactly as
atomc's CPU backend does, so the two should produce the same greedy tokens. The prompts are
tokenized here with the GGUF's own tokenizer; the C test feeds the ids (no tokenizer needed).
EOS is ignored: each continuation is exactly N_NEW tokens of argmax over the raw logits.

Writes tests/fixtures/models/smollm2_refs.json:
  {"prompts": [{"text", "ids", "greedy" (64 ids), "greedy_margins" (top1 - top2 logit per step),
                "last_logits_top" ([id, logit] x 8 of the prompt's last position)}]}

Run: python3 tools/gen_smollm2_refs.py [--gguf PATH]   (default: $ATOMC_SMOLLM2 or scripts/fetch_model.sh)
"""
import argparse
import json
import os
import subprocess

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

N_NEW = 64
PROMPTS = [
    ("plain", "The capital of France is"),
    ("plain", "Once upon a time, in a small village by the sea,"),
    ("plain", "def fibonacci(n):\n    "),
    ("plain", "The three primary colors are"),
    ("plain", "1, 2, 3, 4, 5,"),
    ("chat", "What is the boiling point of water at sea level?"),
    ("chat", "Write a haiku about autumn leaves."),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.environ.get("ATOMC_SMOLLM2"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models",
                                                  "smollm2_refs.json"))
    args = ap.parse_args()
    gguf = args.gguf
    if not gguf:
        root = os.path.join(os.path.dirname(__file__), "..")
        gguf = subprocess.check_output(["bash", os.path.join(root, "scripts", "fetch_model.sh")], text=True).strip()
    d, f = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    out = []
    for kind, text in PROMPTS:
        if kind == "chat":
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok(text)["input_ids"]
        ids = list(ids)
        greedy, margins = [], []
        with torch.no_grad():
            o = model(torch.tensor([ids]), use_cache=True)
            last = o.logits[0, -1].float()
            top8 = torch.topk(last, 8)
            last_top = [[int(i), round(float(v), 5)] for i, v in zip(top8.indices, top8.values)]
            past = o.past_key_values
            for _ in range(N_NEW):
                top2 = torch.topk(last, 2)
                nxt = int(top2.indices[0])
                greedy.append(nxt)
                margins.append(round(float(top2.values[0] - top2.values[1]), 5))
                o = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = o.past_key_values
                last = o.logits[0, -1].float()
        print(f"{kind}: {text!r} -> {tok.decode(greedy)!r} (min margin {min(margins):.4f})")
        out.append(dict(kind=kind, text=text, ids=ids, greedy=greedy, greedy_margins=margins, last_logits_top=last_top))
    with open(args.out, "w") as fh:
        json.dump(dict(model=os.path.basename(gguf), generator="tools/gen_smollm2_refs.py", n_new=N_NEW,
                       prompts=out), fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
