#!/usr/bin/env python3
"""Encode throughput, atomc vs HF `tokenizers`, single thread, same text.

Builds a deterministic ~1 MB mixed English / code / multilingual text (bench/tokenizer_bench.txt
is written next to this script's output dir), then for each tokenizer:
  HF:    Tokenizer.from_file(...).encode(text) in a loop (one string; one thread:
         RAYON_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false)
  atomc: atomc tokenize --model M --bench --file text --seconds S
and prints MB/s of both and the ratio. Both sides are timed in thread CPU time (stable on a
shared machine). Usage:
  python3 bench/tokenizer_bench.py [--shared ../shared] [--seconds 5] [--bin build/atomc] [names...]
"""
import argparse
import os
import random
import re
import subprocess
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import tokenizers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from gen_tokenizer_refs import C_CODE, CODE, english_text  # noqa: E402


def bench_text(n_bytes=1_000_000):
    rng = random.Random(42)
    parts, size = [], 0
    multi = "日本語のテキストと中文文本。Привет, мир! café naïve 👍🏽 "
    while size < n_bytes:
        r = rng.random()
        p = english_text(rng, 2000) if r < 0.6 else (CODE if r < 0.75 else C_CODE if r < 0.9 else multi * 5)
        parts.append(p)
        size += len(p.encode())
    return "".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.environ.get("ATOMC_SHARED", os.path.join(ROOT, "..", "shared")))
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "atomc"))
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--text", default="/tmp/atomc_tokenizer_bench.txt")
    ap.add_argument("--docs", action="store_true", help="encode each blank-line-separated document on its own")
    ap.add_argument("names", nargs="*", default=["llama2", "llama3", "qwen3", "deepseek_v3", "gpt_oss"])
    a = ap.parse_args()
    text = bench_text()
    with open(a.text, "w", encoding="utf-8") as f:
        f.write(text)
    mb = len(text.encode()) / 1e6
    n_docs = len([p for p in re.split(r"(?<=\n\n)", text) if p])
    print(f"text: {a.text}, {mb:.3f} MB, " + (f"{n_docs} documents" if a.docs else "one string"))
    for name in a.names:
        path = os.path.join(a.shared, "tokenizers", name, "tokenizer.json")
        tok = tokenizers.Tokenizer.from_file(path)
        n_ids, iters, t0 = 0, 0, time.thread_time()
        pieces = re.split(r"(?<=\n\n)", text) if a.docs else [text]
        pieces = [p for p in pieces if p]
        while True:
            n_ids = sum(len(tok.encode(p, add_special_tokens=False).ids) for p in pieces)
            iters += 1
            el = time.thread_time() - t0
            if el >= a.seconds:
                break
        hf = mb * iters / el
        out = subprocess.run([a.bin, "tokenize", "--model", os.path.dirname(path), "--bench", "--no-special",
                              "--file", a.text, "--seconds", str(a.seconds)] + (["--docs"] if a.docs else []), capture_output=True, text=True)
        m = re.search(r"-> (\d+) tokens; ([0-9.]+) MB/s", out.stdout)
        if not m:
            print(name, "atomc failed:", out.stderr.strip())
            continue
        ours, our_ids = float(m.group(2)), int(m.group(1))
        same = "same ids count" if our_ids == n_ids else f"ID COUNT DIFFERS ({our_ids} vs {n_ids})"
        print(f"{name:12s} HF tokenizers {hf:7.2f} MB/s   atomc {ours:7.2f} MB/s   ratio {ours / hf:5.2f}x   "
              f"({n_ids} tokens, {same})")


if __name__ == "__main__":
    main()
