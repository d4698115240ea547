#!/usr/bin/env python3
"""Structured output through a running server: 48 concurrent chat requests at temperature 1 under
choice / regex / JSON-schema constraints (vLLM's structured_outputs and response_format); every
output must finish with "stop" and obey its constraint.

  python3 tools/check_structured_server.py PORT   (the served model name must be "m")
"""

import http.client, json, re, sys, threading
port = int(sys.argv[1]); bad = []; n_ok = [0]
def one(i):
    if i % 3 == 0:
        body = {"structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}}; ok = lambda t: t in ("alpha", "beta", "gamma delta")
    elif i % 3 == 1:
        body = {"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}; ok = lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t) is not None
    else:
        body = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}}, "required": ["n", "b"], "additionalProperties": False}}}}
        def ok(t):
            try: v = json.loads(t); return set(v) == {"n", "b"} and isinstance(v["b"], bool) and 0 <= v["n"] <= 9
            except Exception: return False
    body.update({"model": "m", "messages": [{"role": "user", "content": "answer %d" % i}], "max_tokens": 40, "temperature": 1.0, "seed": i})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = json.loads(c.getresponse().read()); c.close()
    ch = r["choices"][0]; t = ch["message"]["content"]
    if ch["finish_reason"] == "stop" and ok(t): n_ok[0] += 1
    else: bad.append((i, ch["finish_reason"], t[:80]))
ths = [threading.Thread(target=one, args=(i,)) for i in range(48)]
[t.start() for t in ths]; [t.join() for t in ths]
print("structured outputs valid: %d of 48" % n_ok[0]); print("bad:", bad[:6])
