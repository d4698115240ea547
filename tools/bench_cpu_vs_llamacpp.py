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

Usage: python3 tools/bench_cpu_vs_llamacpp.py --model M --llama-bench PATH [--threads 2] [--reps 5] [--cpu-time]
Prints one line per measurement, then a table of medians with the load average before / after.

--cpu-time (for a machine shared with other work; meaningful with --threads 1): decode is also
measured in CPU time of the process, as the difference of two runs that decode 160 and 32 tokens
after the same 512-token context (everything else, load, prefill, warm-up, cancels): 128 tokens /
(CPU seconds of the long run - of the short one), both engines, tokens 544..672 of the context.
With more threads a spinning wait counts as CPU time, so there the wall-time figures are the ones
to compare.
"""
import argparse
import json
import os
import resource
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


def child_cpu(cmd, env=None):
    """CPU seconds (user + system) the command used, from the children's rusage."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env, timeout=900)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def cpu_decode(cmd_for):
    """Decode tok/s of CPU time: 128 tokens / (CPU(160 tokens) - CPU(32 tokens))."""
    return 128.0 / (child_cpu(cmd_for(160)) - child_cpu(cmd_for(32)))


def load():
    return os.getloadavg()[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--atomc", default="build/atomc")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true")
    a = ap.parse_args()
    keys = ["atomc_prefill", "atomc_decode", "llama_prefill", "llama_decode", "llama_decode_fa0"]
    if a.cpu_time: keys += ["atomc_decode_cpu", "llama_decode_cpu", "llama_decode_fa0_cpu"]
    res = {k: [] for k in keys}
    l0 = load()
    for rep in range(a.reps):
        p, d = atomc(a.atomc, a.model, a.threads, {})
        res["atomc_prefill"].append(p)
        res["atomc_decode"].append(d)
        res["llama_prefill"].append(llama(a.llama_bench, a.model, a.threads, ["-p", "512", "-n", "0"]))
        res["llama_decode"].append(llama(a.llama_bench, a.model, a.threads, ["-p", "0", "-n", "128", "-d", "512"]))
        res["llama_decode_fa0"].append(
            llama(a.llama_bench, a.model, a.threads, ["-p", "0", "-n", "128", "-d", "512", "-fa", "0"]))
        if a.cpu_time:
            T = str(a.threads)
            res["atomc_decode_cpu"].append(cpu_decode(lambda n: [
                a.atomc, "bench-runner", "--model", a.model, "--prompt-len", "512", "--decode-steps", str(n),
                "--threads", T]))
            for key, extra in (("llama_decode_cpu", []), ("llama_decode_fa0_cpu", ["-fa", "0"])):
                res[key].append(cpu_decode(lambda n: [a.llama_bench, "-m", a.model, "-t", T, "-r", "1", "-p", "0",
                                                      "-n", str(n), "-d", "512"] + extra))
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()) + f" (load {load():.2f})",
              flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    best = max(med["llama_decode"], med["llama_decode_fa0"])
    print(f"threads {a.threads}, {a.reps} interleaved reps, load average {l0:.2f} -> {load():.2f}")
    print(f"| prefill 512 tok/s | atomc {med['atomc_prefill']:.1f} | llama.cpp {med['llama_prefill']:.1f} | "
          f"{med['atomc_prefill'] / med['llama_prefill']:.2f}x |")
    print(f"| decode after 512 tok/s | atomc {med['atomc_decode']:.1f} | llama.cpp {med['llama_decode']:.1f} "
          f"(fa auto), {med['llama_decode_fa0']:.1f} (-fa 0) | {med['atomc_decode'] / best:.2f}x of the best |")
    if a.cpu_time:
        best_cpu = max(med["llama_decode_cpu"], med["llama_decode_fa0_cpu"])
        print(f"| decode after 512, tok/s of CPU time | atomc {med['atomc_decode_cpu']:.1f} | llama.cpp "
              f"{med['llama_decode_cpu']:.1f} (fa auto), {med['llama_decode_fa0_cpu']:.1f} (-fa 0) | "
              f"{med['atomc_decode_cpu'] / best_cpu:.2f}x of the best |")
    print(json.dumps({"threads": a.threads, "reps": a.reps, "load_before": l0, "load_after": load(), "median": med,
                      "all": res}))


if __name__ == "__main__":
    main()
