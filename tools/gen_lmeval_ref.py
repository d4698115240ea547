#!/usr/bin/env python3
"""Reference loglikelihoods for the lm-eval-harness check (tests/py/test_lm_eval.py): for each
question and choice of tests/fixtures/lmeval/atomc_mc.jsonl, log P(choice | question) computed by
HF transformers on SmolLM2-135M-Instruct loaded from its GGUF (dequantized to fp32). Context and
continuation are split into tokens exactly as lm-eval-harness does (`_encode_pair`: trailing
spaces of the context move to the continuation; continuation ids = ids(context + continuation)
after the context's ids), without special tokens.

usage: tools/gen_lmeval_ref.py GGUF > tests/fixtures/lmeval/ref.json
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    d, f = os.path.split(os.path.abspath(sys.argv[1]))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    here = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "lmeval", "atomc_mc.jsonl")
    out = []
    for line in open(here):
        doc = json.loads(line)
        row = []
        for choice in doc["choices"]:
            ctx, cont = doc["question"], " " + choice
            n_sp = len(ctx) - len(ctx.rstrip())
            if n_sp:
                cont, ctx = ctx[-n_sp:] + cont, ctx[:-n_sp]
            whole = tok(ctx + cont, add_special_tokens=False).input_ids
            ctx_ids = tok(ctx, add_special_tokens=False).input_ids
            cont_ids = whole[len(ctx_ids):]
            ids = torch.tensor([ctx_ids + cont_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            ll = sum(logp[len(ctx_ids) + i - 1, t].item() for i, t in enumerate(cont_ids))
            greedy = all(int(logp[len(ctx_ids) + i - 1].argmax()) == t for i, t in enumerate(cont_ids))
            row.append({"loglikelihood": ll, "is_greedy": greedy, "ctx_ids": ctx_ids, "cont_ids": cont_ids})
        out.append({"question": doc["question"], "choices": doc["choices"], "answer": doc["answer"], "ref": row})
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
