#!/usr/bin/env python3
"""Mixed-load probe for prefill/decode disaggregation (issue 27): against one OpenAI-compatible
endpoint (a colocated `atomc serve`, or `atomc proxy` in front of a prefill and a decode instance),
keep `--chats` short streaming completions running back to back (`--chat-in` random prompt ids,
`--chat-out` output tokens, ignore_eos) while long prompts (`--long-in` ids, `--long-out` output
tokens) arrive every `--long-every` seconds, for `--seconds`. Prints, for the chats: completed
requests, output tok/s, inter-token latency p50 / p90 / p99 / max and TTFT p50 / p99 (ms); for the
long prompts: count and TTFT p50 / max. Chats started before `--warmup` seconds are not counted.
Prompts are token-id lists (no tokenizer needed); ids are drawn from [100, --vocab).

  python3 tools/bench_pd_mixed.py --port 8000 --model m --seconds 60 --json out.json
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time


def stream(port, body, timeout=600):
    """POST a streaming completion; returns (send time, [arrival time of each token chunk])."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    times = []
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("error"):
            raise RuntimeError(str(ev["error"]))
        ch = ev.get("choices") or []
        if ch and ch[0].get("text"):
            times.append(time.perf_counter())
    c.close()
    return t0, times


def pct(v, p):
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(round(p / 100.0 * (len(v) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="m")
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--chat-in", type=int, default=128)
    ap.add_argument("--chat-out", type=int, default=256)
    ap.add_argument("--long-in", type=int, default=8192)
    ap.add_argument("--long-out", type=int, default=16)
    ap.add_argument("--long-every", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    lock = threading.Lock()
    chats, longs, errors = [], [], []
    start = time.perf_counter()
    end = start + a.seconds

    def body(n_in, n_out, seed):
        r = random.Random(seed)
        return {"model": a.model, "prompt": [r.randrange(100, a.vocab) for _ in range(n_in)], "max_tokens": n_out,
                "temperature": 0, "ignore_eos": True, "stream": True}

    def chat_loop(i):
        k = 0
        while time.perf_counter() < end:
            try:
                t0, ts = stream(a.port, body(a.chat_in, a.chat_out, a.seed * 1000003 + i * 7919 + k))
                with lock:
                    chats.append((t0, ts))
            except Exception as e:  # noqa: BLE001 - recorded and reported
                with lock:
                    errors.append(f"chat: {e}")
                time.sleep(0.5)
            k += 1

    def long_one(j):
        try:
            t0, ts = stream(a.port, body(a.long_in, a.long_out, 10**9 + j))
            with lock:
                longs.append((t0, ts))
        except Exception as e:  # noqa: BLE001
            with lock:
                errors.append(f"long: {e}")

    ths = [threading.Thread(target=chat_loop, args=(i,), daemon=True) for i in range(a.chats)]
    for t in ths:
        t.start()
    lts, j = [], 0
    while time.perf_counter() < end:
        time.sleep(a.long_every * (0.5 + rng.random()))
        if time.perf_counter() >= end:
            break
        t = threading.Thread(target=long_one, args=(j,), daemon=True)
        t.start()
        lts.append(t)
        j += 1
    for t in ths + lts:
        t.join(timeout=600)
    itl, ttft, toks = [], [], 0
    t_lo, t_hi = start + a.warmup, end
    for t0, ts in chats:
        if t0 < t_lo or not ts:
            continue
        ttft.append((ts[0] - t0) * 1e3)
        itl += [(y - x) * 1e3 for x, y in zip(ts, ts[1:])]
        toks += len(ts)
    span = max(1e-9, (max((ts[-1] for t0, ts in chats if ts), default=t_hi)) - t_lo)
    lt = [(ts[0] - t0) * 1e3 for t0, ts in longs if ts]
    res = {"chats_counted": sum(1 for t0, ts in chats if t0 >= t_lo and ts), "chat_output_tok_s": toks / span,
           "itl_ms": {"p50": pct(itl, 50), "p90": pct(itl, 90), "p99": pct(itl, 99), "max": max(itl, default=0)},
           "chat_ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
           "long_prompts": len(lt), "long_ttft_ms": {"p50": pct(lt, 50), "max": max(lt, default=0)},
           "errors": len(errors), "first_errors": errors[:3]}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if errors or not itl else 0


if __name__ == "__main__":
    raise SystemExit(main())
