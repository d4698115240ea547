"""A scripted OpenAI-style streaming server used to check the benchmark client's
measurements: every request gets its first token after TTFT_MS and the following ones
ITL_MS apart, so the expected TTFT / TPOT / ITL / token counts are known exactly.
Requests asking for an odd max_tokens get HTTP 500 (to exercise failure counting).

usage: python3 sse_stub_server.py PORT TTFT_MS ITL_MS [fail-odd]
"""
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body.get("prompt")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if FAIL_ODD and n % 2 == 1:
            msg = b'{"error": {"message": "scripted failure", "type": "server_error"}}'
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
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


if __name__ == "__main__":
    port, TTFT, ITL = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    FAIL_ODD = len(sys.argv) > 4 and sys.argv[4] == "fail-odd"
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 1024
    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    srv.serve_forever()
