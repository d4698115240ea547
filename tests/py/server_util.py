"""Helpers for the server tests: start `atomc serve` on a free loopback port, wait until
/health is 200, stop it with SIGTERM (which must drain and exit 0), raw HTTP requests."""
import http.client
import json
import os
import signal
import socket
import subprocess
import time

ATOMC_BIN = os.environ.get("ATOMC_BIN", "build/atomc")
SMOLLM2 = os.environ.get("ATOMC_SMOLLM2")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *extra, api_key=None, env=None, ready_timeout=180, preexec_fn=None):
        self.port = free_port()
        self.api_key = api_key
        self.base = f"http://127.0.0.1:{self.port}"
        args = [ATOMC_BIN, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(self.port), *extra]
        if api_key:
            args += ["--api-key", api_key]
        e = dict(os.environ)
        e.pop("VLLM_API_KEY", None)
        e.pop("ATOMC_API_KEY", None)
        e.setdefault("ATOMC_LOG", "warn")
        if env:
            e.update(env)
        self.log_path = f"/tmp/atomc-serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=e, preexec_fn=preexec_fn)
        deadline = time.time() + ready_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"atomc serve exited with {self.proc.returncode}: {self.read_log()}")
            try:
                status, _, _ = self.request("GET", "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"atomc serve did not become healthy: {self.read_log()}")

    def read_log(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def headers(self, auth=True):
        h = {"Content-Type": "application/json"}
        if auth and self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def request(self, method, path, body=None, headers=None, timeout=120, auth=True):
        """Raw HTTP; body may be bytes, str or a JSON-able object. Returns (status, headers, bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        conn.request(method, path, body=body, headers=headers if headers is not None else self.headers(auth))
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, dict(r.getheaders()), data

    def json(self, method, path, body=None, **kw):
        status, _, data = self.request(method, path, body, **kw)
        return status, json.loads(data) if data else None

    def metrics(self):
        status, _, data = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def metric(self, name, **labels):
        """Sum of a metric's samples whose labels include `labels`."""
        total = 0.0
        for k, v in self.metrics().items():
            base = k.split("{", 1)[0]
            if base != name:
                continue
            if all(f'{lk}="{lv}"' in k for lk, lv in labels.items()):
                total += v
        return total

    def stop(self, timeout=60):
        """SIGTERM: must drain and exit 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        self.log.close()
        return self.proc.returncode
