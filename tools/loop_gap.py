#!/usr/bin/env python3
"""Event-loop stall probe (issue 28 item 2): the largest gap between the SSE chunks of one streaming
completion while a 30 MB /tokenize or /v1/completions body is being handled by the same server.
Work done on the loop thread (JSON parsing, tokenizing) shows up as a gap of its duration.
    ATOMC_SMOLLM2=path/to/SmolLM2-135M-Instruct.Q4_1.gguf python3 tools/loop_gap.py"""
import http.client
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "py"))
from server_util import SMOLLM2, Server  # noqa: E402


def stream(port, out):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 400,
                                                     "ignore_eos": True, "stream": True, "temperature": 0}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    while True:
        line = r.fp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            out.append(time.monotonic())


def main():
    s = Server(SMOLLM2, "--max-model-len", "2048", "--max-request-body-bytes", "64M")
    big = json.dumps({"prompt": "hello world " * 2_600_000})  # ~31 MB
    cases = [("idle", None, None), ("30 MB /tokenize", "/tokenize", big),
             ("30 MB /v1/completions (400: longer than the context)", "/v1/completions",
              big[:-1] + ', "max_tokens": 1}')]
    try:
        for label, path, body in cases:
            ts = []
            th = threading.Thread(target=stream, args=(s.port, ts))
            th.start()
            time.sleep(1.0)
            res = ""
            if path:
                t = time.monotonic()
                st = s.request("POST", path, body, timeout=300)[0]
                res = f"; the big request: {st} in {time.monotonic() - t:.2f} s"
            th.join()
            gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
            print(f"{label}: {len(ts)} chunks, max gap {gaps[-1] * 1000:.0f} ms, median {gaps[len(gaps) // 2] * 1000:.0f} ms{res}")
    finally:
        s.stop()


if __name__ == "__main__":
    main()
