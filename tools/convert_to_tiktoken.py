#!/usr/bin/env python3
"""Writes a byte-level BPE tokenizer.json in tiktoken form, the layout Kimi-K2 / Moonlight ship:
tiktoken.model ("<base64 token bytes> <rank>" per line, rank = id) + tokenizer_config.json
(added_tokens_decoder, bos/eos, chat template carried over). The vocabulary must be byte-level
(GPT-2 byte alphabet) with ids 0..N-1 dense, as tiktoken-derived vocabularies (Llama-3, o200k) are.

  --pattern split   tokenizer_config.json gets "pat_str": the tokenizer.json's Split regex
  --pattern kimi    no pat_str; auto_map names Kimi's tokenization_kimi, so a loader must know
                    Kimi's own pattern (as transformers' remote code does)

usage: convert_to_tiktoken.py TOKENIZER_DIR OUT_DIR [--pattern split|kimi]
Used by tests/py/test_tiktoken.py; atomc loads the result (src/tokenizer/tokenizer_tiktoken.c)."""
import argparse
import base64
import json
import os


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def convert(src, out, pattern="split"):
    tj = json.load(open(os.path.join(src, "tokenizer.json")))
    cfg_path = os.path.join(src, "tokenizer_config.json")
    cfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
    model = tj["model"]
    assert model["type"] == "BPE", model["type"]
    inv = {c: b for b, c in bytes_to_unicode().items()}
    vocab = model["vocab"]
    ranks = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in ranks] == list(range(len(ranks))), "ids are not dense 0..N-1"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tiktoken.model"), "w") as f:
        for piece, rank in ranks:
            raw = bytes(inv[c] for c in piece)
            f.write(f"{base64.b64encode(raw).decode()} {rank}\n")
    added = {str(t["id"]): {"content": t["content"], "special": t.get("special", False), "lstrip": False,
                            "rstrip": False, "normalized": False, "single_word": False}
             for t in tj.get("added_tokens", []) if t["id"] >= len(ranks)}
    new_cfg = {"added_tokens_decoder": added, "tokenizer_class": "TikTokenTokenizer"}
    for k in ("bos_token", "eos_token", "chat_template", "add_bos_token"):
        if k in cfg:
            new_cfg[k] = cfg[k]
    if pattern == "split":
        pre = tj["pre_tokenizer"]
        splits = [p for p in pre.get("pretokenizers", [pre]) if p["type"] == "Split"]
        assert len(splits) == 1, "expected one Split pre-tokenizer"
        new_cfg["pat_str"] = splits[0]["pattern"]["Regex"]
    else:
        new_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    json.dump(new_cfg, open(os.path.join(out, "tokenizer_config.json"), "w"), ensure_ascii=False, indent=1)
    return [bytes(inv[c] for c in p) for p, _ in ranks], {t["content"]: t["id"] for t in tj.get("added_tokens", [])}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--pattern", choices=["split", "kimi"], default="split")
    a = ap.parse_args()
    convert(a.src, a.out, a.pattern)
