#!/usr/bin/env python3
"""atomc's CPU backend against llama.cpp on the same GGUF, same threads, same run, interleaved:
batch-1 decode of 128 tokens after a 512-token context and a 512-token prefill, repeated, medians.

  atomc:     atomc bench-runner --model M --prompt-len 512 --decode-steps 128 --threads T --json
             (one prefill of 512 tokens, 4 untimed + 128 timed greedy decode steps)
  llama.cpp: llama-bench -m M -t T -p 512 -n 0            (prefill)
             llama-bench -m M -t T -p 0 -n 128 -d 512      (decode after 512, flash attention auto)
             llama-bench -m M -t T -p 0 -n 128 -d 512 -fa 0

llama.cpp is built from the llama-cpp-python sdist outside the repository (never committed), e.g.
  cmake -B build -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
        -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" && cmake --build build --target llama-bench

Usage: python3 tools/bench_cpu_vs_llamacpp.py --model M --llama-bench PATH [--threads 2] [--reps 5]
Prints one line per measurement, then a table of medians with the load average before / after.
"""
import argparse
import json
import os
import statistics
import subprocess


def atomc(bin_, model, threads, env_extra):
    env = dict(os.environ)
    env.update(env_extra)
    r = subprocess.run([bin_, "bench-runner", "--model", model, "--prompt-len", "512", "--decode-steps", "128",
                        "--threads", str(threads), "--json"], capture_output=True, text=True, env=env, timeout=900)
    r.check_returncode()
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return d["prefill_tok_s"], d["decode_tok_s"]


def llama(lb, model, threads, args):
    r = subprocess.run([lb, "-m", model, "-t", str(threads), "-r", "1", "-o", "json"] + args, capture_output=True,
                       text=True, timeout=900)
    r.check_returncode()
    return json.loads(r.stdout)[0]["avg_ts"]


def load():
    return os.getloadavg()[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--atomc", default="build/atomc")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    res = {k: [] for k in ("atomc_prefill", "atomc_decode", "llama_prefill", "llama_decode", "llama_decode_fa0")}
    l0 = load()
    for rep in range(a.reps):
        p, d = atomc(a.atomc, a.model, a.threads, {})
        res["atomc_prefill"].append(p)
        res["atomc_decode"].append(d)
        res["llama_prefill"].append(llama(a.llama_bench, a.model, a.threads, ["-p", "512", "-n", "0"]))
        res["llama_decode"].append(llama(a.llama_bench, a.model, a.threads, ["-p", "0", "-n", "128", "-d", "512"]))
        res["llama_decode_fa0"].append(
            llama(a.llama_bench, a.model, a.threads, ["-p", "0", "-n", "128", "-d", "512", "-fa", "0"]))
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()) + f" (load {load():.2f})",
              flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    best = max(med["llama_decode"], med["llama_decode_fa0"])
    print(f"threads {a.threads}, {a.reps} interleaved reps, load average {l0:.2f} -> {load():.2f}")
    print(f"| prefill 512 tok/s | atomc {med['atomc_prefill']:.1f} | llama.cpp {med['llama_prefill']:.1f} | "
          f"{med['atomc_prefill'] / med['llama_prefill']:.2f}x |")
    print(f"| decode after 512 tok/s | atomc {med['atomc_decode']:.1f} | llama.cpp {med['llama_decode']:.1f} "
          f"(fa auto), {med['llama_decode_fa0']:.1f} (-fa 0) | {med['atomc_decode'] / best:.2f}x of the best |")
    print(json.dumps({"threads": a.threads, "reps": a.reps, "load_before": l0, "load_after": load(), "median": med,
                      "all": res}))


if __name__ == "__main__":
    main()
