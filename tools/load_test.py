#!/usr/bin/env python3
"""Load test for `atomc serve` on loopback: many concurrent streaming clients, some of which
hang up mid-stream at random. Checks that every request ends with a full response (finish
reason + [DONE]) or a proper JSON error, that no KV blocks leak (vllm:kv_cache_usage_perc and
vllm:num_requests_running return to 0, aborts are counted), and that the server's RSS stays flat
across waves.

  python3 tools/load_test.py --url http://127.0.0.1:8000 --clients 500 --waves 3 [--api-key K]
  python3 tools/load_test.py --model $ATOMC_SMOLLM2 --clients 500    # starts its own server

Prints a JSON summary; exit status 1 if any request ended badly or a leak was seen.
No dependencies beyond the standard library (raw HTTP over asyncio streams)."""
import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

PROMPTS = ["Tell me about the sea.", "Write a haiku about autumn.", "What is 2 + 2?", "List three colors.",
           "Explain gravity to a child.", "Once upon a time", "The quick brown fox", "Describe a cat."]


def http_get(url, path, key=None, timeout=10):
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def metrics(url):
    out = {}
    for line in http_get(url, "/metrics").splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            base = k.split("{", 1)[0]
            if "finished_reason=" in k:
                base += "." + k.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[base] = out.get(base, 0.0) + float(v)
    return out


def rss_kib(pid):
    if not pid:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


async def one_client(host, port, key, model, rng, abort_p, max_tokens, timeout, half_close_p=0.0, slow_p=0.0):
    """Returns (outcome, detail). outcome: complete | aborted | error | broken. A half-closing client
    shuts down its write side after the request (it must still get the whole stream); a slow one
    reads 256 bytes at a time with a pause between reads."""
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, max_tokens), "stream": True,
            "temperature": rng.choice([0, 0.7, 1.0]), "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    data = json.dumps(body).encode()
    # A disconnecting client hangs up after a random number of events, 0 (right after sending the
    # request) to max_tokens (after the last token: the response may be complete by then).
    abort_after = rng.randint(0, body["max_tokens"]) if rng.random() < abort_p else None
    half_close = rng.random() < half_close_p
    slow = rng.random() < slow_p
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n")
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except Exception as e:
        return "broken", f"connect: {e}"
    try:
        writer.write(head.encode() + b"\r\n" + data)
        await writer.drain()
        if abort_after == 0:
            return "aborted", 0
        if half_close:
            writer.write_eof()
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        parts = status_line.decode(errors="replace").split()
        if len(parts) < 2:
            return "broken", f"bad status line {status_line!r}"
        status = int(parts[1])
        headers = {}
        while True:
            line = await asyncio.wait_for(reader.readline(), timeout)
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if status != 200:
            raw = await asyncio.wait_for(reader.read(), timeout)
            if b"\r\n" in raw and headers.get("transfer-encoding") == "chunked":
                raw = raw.split(b"\r\n", 1)[1]
            try:
                j = json.loads(raw.split(b"\r\n0\r\n")[0])
                assert "message" in j["error"]
                return "error", status
            except Exception:
                return "broken", f"status {status} without a JSON error: {raw[:200]!r}"
        events, finish, buf = 0, None, b""
        while True:
            if slow:
                await asyncio.sleep(0.02)
            chunk = await asyncio.wait_for(reader.read(256 if slow else 65536), timeout)
            if not chunk:
                return "broken", f"EOF after {events} events without [DONE]"
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                idx = ev.find(b"data: ")
                if idx < 0:
                    continue
                payload = ev[idx + 6:]
                if payload.strip() == b"[DONE]":
                    return ("complete", events) if finish else ("broken", "[DONE] without finish_reason")
                j = json.loads(payload)
                if "error" in j:
                    return "error", "mid-stream " + j["error"]["message"]
                events += 1
                for c in j.get("choices", []):
                    if c.get("finish_reason"):
                        finish = c["finish_reason"]
                if abort_after is not None and events >= abort_after and not finish:
                    return "aborted", events
    except asyncio.TimeoutError:
        return "broken", "timeout"
    except (ConnectionError, OSError) as e:
        return "broken", f"{type(e).__name__}: {e}"
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except Exception:
            pass


async def wave(args, host, port, seed):
    rng = random.Random(seed)
    tasks = [one_client(host, port, args.api_key, args.model_name, random.Random(rng.random()), args.abort_prob,
                        args.max_tokens, args.timeout, args.half_close_prob, args.slow_prob)
             for _ in range(args.clients)]
    return await asyncio.gather(*tasks)


def wait_idle(url, timeout=60):
    deadline = time.time() + timeout
    m = metrics(url)
    while time.time() < deadline:
        m = metrics(url)
        if m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting", 1) == 0 and \
                m.get("vllm:kv_cache_usage_perc", 1) == 0:
            return m, True
        time.sleep(0.2)
    return m, False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="server base URL (omit with --model to start one)")
    ap.add_argument("--model", help="start `atomc serve --model MODEL` on a free port")
    ap.add_argument("--atomc", default=os.environ.get("ATOMC_BIN", "build/atomc"))
    ap.add_argument("--server-args", default="--max-model-len 512", help="extra args for the started server")
    ap.add_argument("--pid", type=int, help="server pid, for RSS (found automatically when started here)")
    ap.add_argument("--api-key")
    ap.add_argument("--model-name", help="\"model\" field to send")
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--abort-prob", type=float, default=0.3)
    ap.add_argument("--half-close-prob", type=float, default=0.2,
                    help="fraction of clients that shut down their write side after the request")
    ap.add_argument("--slow-prob", type=float, default=0.1, help="fraction of clients that read slowly")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--server-log", help="write the started server's output here (default: discarded)")
    ap.add_argument("--max-log-bytes", type=int, default=1 << 20,
                    help="with --server-log: fail if the server wrote more than this (a log flood)")
    args = ap.parse_args()

    proc = None
    if not args.url:
        if not args.model:
            ap.error("give --url or --model")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL
        proc = subprocess.Popen([args.atomc, "serve", "--model", args.model, "--port", str(port),
                                 *args.server_args.split()], stdout=log, stderr=subprocess.STDOUT)
        args.url = f"http://127.0.0.1:{port}"
        args.pid = proc.pid
        for _ in range(600):
            try:
                http_get(args.url, "/health", timeout=1)
                break
            except Exception:
                if proc.poll() is not None:
                    sys.exit("server exited during start-up")
                time.sleep(0.2)
    host, port = args.url.split("//", 1)[1].split(":")
    port = int(port.rstrip("/"))
    # One connection per client: make sure this process may open that many.
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.clients)), hard))
    except Exception:
        pass

    summary = {"clients_per_wave": args.clients, "waves": [], "ok": True}
    m0 = metrics(args.url)
    rss = [rss_kib(args.pid)]
    for w in range(args.waves):
        t0 = time.time()
        results = asyncio.run(wave(args, host, port, seed=w))
        dt = time.time() - t0
        counts = {}
        for outcome, _ in results:
            counts[outcome] = counts.get(outcome, 0) + 1
        broken = [d for o, d in results if o == "broken"]
        m, idle = wait_idle(args.url)
        rss.append(rss_kib(args.pid))
        summary["waves"].append({"seconds": round(dt, 2), "outcomes": counts, "idle_after": idle,
                                 "kv_cache_usage_after": m.get("vllm:kv_cache_usage_perc"),
                                 "running_after": m.get("vllm:num_requests_running"),
                                 "rss_kib_after": rss[-1], "broken_examples": broken[:5]})
        if broken or not idle:
            summary["ok"] = False
    m1 = metrics(args.url)
    ours = sum(w["outcomes"].get("aborted", 0) for w in summary["waves"])
    summary["aborted_by_clients"] = ours
    summary["server_abort_count_delta"] = m1.get("vllm:request_success_total.abort", 0) - \
        m0.get("vllm:request_success_total.abort", 0)
    summary["generation_tokens"] = m1.get("vllm:generation_tokens_total", 0) - m0.get("vllm:generation_tokens_total", 0)
    summary["rss_kib"] = rss
    # Requests aborted by a client after the engine had already finished them count as finished,
    # so the server's abort count may be lower than ours, never higher.
    if summary["server_abort_count_delta"] > ours:
        summary["ok"] = False
    if len(rss) > 2 and rss[1] and rss[-1] and rss[-1] > rss[1] * 1.10 + 8192:
        summary["ok"] = False
        summary["rss_growth"] = "RSS grew more than 10% between the first and the last wave"
    if proc:
        proc.send_signal(signal.SIGTERM)
        summary["server_exit"] = proc.wait(120)
        if summary["server_exit"] != 0:
            summary["ok"] = False
        if args.server_log:
            summary["server_log_bytes"] = os.path.getsize(args.server_log)
            if summary["server_log_bytes"] > args.max_log_bytes:
                summary["log_flood"] = f"the server wrote more than {args.max_log_bytes} bytes of log"
                summary["ok"] = False
    print(json.dumps(summary, indent=2))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
