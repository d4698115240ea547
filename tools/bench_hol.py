#!/usr/bin/env python3
"""Head-of-line blocking probe (issue 28 item 3): against a running `atomc serve`, send one long
completion (`--long` prompt tokens of id 28, max_tokens 1, optionally echo + logprobs 20) and,
`--delay` seconds later, a short one (a few tokens, max_tokens 2, streamed); print the long
request's total time and the short request's time to first token and total, in seconds; with
`--pid` (the server's), also the server's CPU time (user + system, all threads) over the run,
which a loaded machine disturbs less than wall time. `--no-short` sends the long request alone.

  python3 tools/bench_hol.py --port 8000 --long 8000 [--echo] [--pid PID] [--no-short]
"""
import os
import argparse
import http.client
import json
import threading
import time


def post(port, body, stream=False, timeout=3600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return c, r


def cpu_s(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--long", type=int, default=8000)
    ap.add_argument("--echo", action="store_true")
    ap.add_argument("--delay", type=float, default=1.0)
    ap.add_argument("--pid", type=int)
    ap.add_argument("--no-short", action="store_true")
    a = ap.parse_args()
    res = {}
    cpu0 = cpu_s(a.pid) if a.pid else None

    def long_req():
        body = {"prompt": [28] * a.long, "max_tokens": 1}
        if a.echo:
            body.update(echo=True, logprobs=20)
        t0 = time.monotonic()
        c, r = post(a.port, body)
        data = r.read()
        res["long_status"] = r.status
        res["long_total_s"] = time.monotonic() - t0
        res["long_bytes"] = len(data)
        c.close()

    th = threading.Thread(target=long_req)
    th.start()
    if a.no_short:
        th.join()
        if cpu0 is not None:
            res["server_cpu_s"] = cpu_s(a.pid) - cpu0
        res["load1"] = os.getloadavg()[0]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))
        return
    time.sleep(a.delay)
    t0 = time.monotonic()
    c, r = post(a.port, {"prompt": "The capital of France is", "max_tokens": 2, "stream": True})
    ttft = None
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: {") and ttft is None:
            ttft = time.monotonic() - t0
    res["short_status"] = r.status
    res["short_ttft_s"] = ttft
    res["short_total_s"] = time.monotonic() - t0
    c.close()
    th.join()
    if cpu0 is not None:
        res["server_cpu_s"] = cpu_s(a.pid) - cpu0
    res["load1"] = os.getloadavg()[0]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    main()
