"""A scripted OpenAI-style streaming server used to check the benchmark client's
measurements: every request gets its first token after TTFT_MS and the following ones
ITL_MS apart, so the expected TTFT / TPOT / ITL / token counts are known exactly.
Options (after the three numbers, any order):
  fail-odd   requests asking for an odd max_tokens get HTTP 500 (to exercise failure counting)
  fail-all   every request gets HTTP 500
  close      close the kept-alive connection after each streamed response without announcing it
             (llama-server does so), so a client must re-send on a new connection
  vocab=N    GET /tokenizer_info answers {"vocab_size": N} (as vLLM / atomc do) and a prompt holding
             a token id >= N gets HTTP 400 (as a real server does)

usage: python3 sse_stub_server.py PORT TTFT_MS ITL_MS [fail-odd] [fail-all] [close] [vocab=N]
"""
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_json(self, code, obj):
        msg = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(msg)))
        self.end_headers()
        self.wfile.write(msg)

    def do_GET(self):
        if self.path == "/tokenizer_info" and VOCAB:
            self.send_json(200, {"vocab_size": VOCAB})
        else:
            self.send_json(404, {"error": {"message": "not found", "type": "not_found"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body.get("prompt")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if FAIL_ALL or (FAIL_ODD and n % 2 == 1):
            self.send_json(500, {"error": {"message": "scripted failure", "type": "server_error"}})
            return
        if VOCAB and isinstance(prompt, list) and any(t >= VOCAB for t in prompt):
            self.send_json(400, {"error": {"message": "token id out of vocabulary", "type": "invalid_request_error"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(obj):
            data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        time.sleep(TTFT / 1000.0)
        for i in range(n):
            if i:
                time.sleep(ITL / 1000.0)
            chunk({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " tok", "finish_reason": None}]})
        plen = len(prompt) if isinstance(prompt, list) else 1
        chunk({"id": "cmpl-1", "object": "text_completion", "choices": [],
               "usage": {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}})
        chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        if CLOSE:
            self.close_connection = True


if __name__ == "__main__":
    port, TTFT, ITL = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    opts = sys.argv[4:]
    FAIL_ODD, FAIL_ALL, CLOSE = "fail-odd" in opts, "fail-all" in opts, "close" in opts
    VOCAB = next((int(o[6:]) for o in opts if o.startswith("vocab=")), 0)
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 1024
    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    srv.serve_forever()
