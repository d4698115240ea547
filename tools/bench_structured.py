#!/usr/bin/env python3
"""Structured-output overhead: decode tok/s of `atomc serve` with and without a JSON schema, at
batch 1 and batch 16, in one run (docs/perf.md). Every request generates exactly --tokens tokens:
the schema is a string of at least 4000 characters, so the grammar never ends first, and the
unconstrained requests use ignore_eos. Decode rate = (tokens - 1) / (last token time - first token
time), from streamed chunks, summed over the concurrent requests (median of --reps rounds). Also
the server's CPU time (user + sys from /proc) per generated token, which a loaded shared machine
disturbs less than wall time.

  python3 tools/bench_structured.py --model $ATOMC_SMOLLM2 [--tokens 128] [--reps 3] [--top-p P]

On the GPU machine (CUDA build, dummy weights; --max-num-seqs at least the largest batch):

  python3 tools/bench_structured.py --bin build-cuda/atomc --model DIR --batches 1,16,64 \
      --max-num-seqs 64 --server-args "--device cuda --load-format dummy"

--server-args is split like a shell line and appended to `atomc serve`'s arguments (e.g.
"--grammar-threads 1" to compare with one mask thread).

At temperature 1 with top_p 1 (the default) the CPU engine draws constrained rows unmasked and
checks the token (sample-then-check, src/engine/engine_grammar.c); --top-p below 1 (applied to
both kinds of request) puts every constrained row through the mask filled during the forward
instead. The server's count of checked and redrawn rows is printed at the end.
"""
import argparse
import http.client
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time

# A list of records that cannot be complete within --tokens (64 items), so every request runs to
# max_tokens. (Not a string with a huge minLength: xgrammar's accept costs ~0.8 ms a token there.)
SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "word": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["word", "n"]}, "minItems": 64}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(port, body, out, i):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    times, n = [], 0
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            n = ev["usage"]["completion_tokens"]
        if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
            times.append(time.perf_counter())
    conn.close()
    out[i] = (n, times[0], times[-1])


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")


def round_rate(port, batch, tokens, constrained, seed, top_p=1.0):
    body = {"model": "m", "messages": [{"role": "user", "content": "Write a long story about a robot."}],
            "max_tokens": tokens, "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}
    if top_p < 1.0:
        body["top_p"] = top_p
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    out = [None] * batch
    ths = []
    for i in range(batch):
        b = dict(body, seed=seed + i)
        ths.append(threading.Thread(target=one_request, args=(port, b, out, i)))
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert all(o and o[0] == tokens for o in out), out
    # Aggregate decode rate over the window where all requests were decoding together.
    t0 = max(o[1] for o in out)
    t1 = min(o[2] for o in out)
    per = [(o[0] - 1) / (o[2] - o[1]) for o in out]
    return sum(per), t1 - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("ATOMC_SMOLLM2"))
    ap.add_argument("--bin", default="build/atomc")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--server-args", default="", help="extra arguments appended to `atomc serve` (shell-split)")
    a = ap.parse_args()
    if max(int(x) for x in a.batches.split(",")) > a.max_num_seqs:
        print(f"note: batches above --max-num-seqs {a.max_num_seqs} do not all decode together", file=sys.stderr)
    port = free_port()
    log = open("/tmp/bench_structured_server.log", "w")
    proc = subprocess.Popen([a.bin, "serve", "--model", a.model, "--port", str(port), "--host", "127.0.0.1",
                             "--served-model-name", "m", "--max-num-seqs", str(a.max_num_seqs),
                             "--max-model-len", str(a.max_model_len)] + shlex.split(a.server_args),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if proc.poll() is not None:
                sys.exit(f"atomc serve exited with {proc.returncode}; see /tmp/bench_structured_server.log")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        round_rate(port, 1, 8, True, 0)  # warm-up: compiles the schema (then cached)
        round_rate(port, 1, 8, False, 0)
        print(f"{'batch':>5} {'plain tok/s':>12} {'schema tok/s':>13} {'overhead':>9} "
              f"{'plain cpu ms/tok':>17} {'schema cpu ms/tok':>18} {'cpu overhead':>13}")
        for batch in [int(x) for x in a.batches.split(",")]:
            res = {False: ([], []), True: ([], [])}
            for r in range(a.reps):  # interleaved, so drift hits both alike
                for c in (False, True):
                    c0 = cpu_seconds(proc.pid)
                    rate = round_rate(port, batch, a.tokens, c, 100 * r, a.top_p)[0]
                    res[c][0].append(rate)
                    res[c][1].append((cpu_seconds(proc.pid) - c0) * 1e3 / (batch * a.tokens))
            p, s = statistics.median(res[False][0]), statistics.median(res[True][0])
            pc, sc = statistics.median(res[False][1]), statistics.median(res[True][1])
            print(f"{batch:>5} {p:>12.1f} {s:>13.1f} {100 * (p - s) / p:>8.1f}% {pc:>17.2f} {sc:>18.2f} "
                  f"{100 * (sc - pc) / pc:>12.1f}%", flush=True)
    finally:
        proc.terminate()
        proc.wait()
        log.close()
        with open("/tmp/bench_structured_server.log") as f:
            for line in f:
                if "grammar CPU" in line or "mask threads" in line:
                    print(line.split("] ", 1)[-1].strip())


if __name__ == "__main__":
    sys.exit(main())
