"""Prefill/decode disaggregation on loopback (issue 24): `atomc proxy` in front of one prefill
instance (kv_producer) and one decode instance (kv_consumer), SmolLM2 on the CPU backend.

- unclaimed, late and aborted transfers (no proxy): held blocks freed after hold_timeout_s, a late
  KV prefilled locally with the same tokens, an abort while waiting leaves nothing behind.
- 200 concurrent greedy completions through the proxy equal a single instance's, token for token
  (text, finish reason and completion tokens); the producer sends each layer's KV as the forward
  writes it (some frames are queued before their forward returns); the decode instance computes exactly one prompt
  token per request (the last), receives every prompt's KV, falls back never; the bytes sent and
  received equal the prompts' KV bytes (prompt tokens x 30 layers x K+V x 3 KV heads x 64 dims x
  2 bytes of BF16) less the leading blocks the decode instance already had cached (not sent);
  afterwards both instances hold no KV blocks.
- streaming chat through the proxy equals the single instance's non-streaming answer.
- the prefill instance SIGKILLed mid-run (120 concurrent requests, after it sent 30 transfers): every
  request still completes with the same tokens
  (the proxy fails over to a local prefill on the decode instance; transfers from the dead
  producer fail over at once), and the decode instance's blocks return to zero.
Needs ATOMC_SMOLLM2."""
import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from server_util import ATOMC_BIN, SMOLLM2, Server, free_port

pytestmark = pytest.mark.skipif(not SMOLLM2, reason="set ATOMC_SMOLLM2")

KV_TOKEN_BYTES = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: layers x (K, V) x KV heads x head dim x bf16
WORDS = ["river", "mountain", "engine", "garden", "number", "planet", "story", "music", "window", "market",
         "winter", "silver", "forest", "bridge", "letter", "doctor"]


def prompts(n):
    out = []
    for i in range(n):
        k = 3 + (i * 7) % 24  # 3..26 words: prompts of one to three KV blocks (partial last blocks too)
        words = [WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(k)]
        out.append(f"Note {i}: " + " ".join(words) + " and then")
    return out


def post(port, path, body, timeout=300):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


def complete(port, prompt, max_tokens):
    status, data = post(port, "/v1/completions",
                        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, data
    j = json.loads(data)
    c = j["choices"][0]
    return c["text"], c["finish_reason"], j["usage"]["completion_tokens"], j["usage"]["prompt_tokens"]


def run_all(port, ps, max_tokens=4, workers=200):
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        return list(ex.map(lambda p: complete(port, p, max_tokens), ps))


class Proxy:
    def __init__(self, prefill, decode):
        self.port = free_port()
        self.log_path = f"/tmp/atomc-proxy-{self.port}.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, ATOMC_LOG="warn")
        self.proc = subprocess.Popen([ATOMC_BIN, "proxy", "--port", str(self.port), "--prefill", prefill,
                                      "--decode", decode, "--health-interval", "0.3"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 30
        while time.time() < deadline:
            assert self.proc.poll() is None, open(self.log_path).read()
            try:
                m = self.metrics()
                if m and all(v == 1 for k, v in m.items() if k.startswith("atomc_proxy:instance_up")):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("proxy did not see its instances up: " + open(self.log_path).read())

    def metrics(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        conn.request("GET", "/metrics")
        data = conn.getresponse().read().decode()
        conn.close()
        out = {}
        for line in data.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        self.log.close()


def kv_config(role, port, engine_id):
    return json.dumps({"kv_connector": "tcp", "kv_role": role, "kv_ip": "127.0.0.1", "kv_port": port,
                       "kv_connector_extra_config": {"engine_id": engine_id, "timeout_s": 30}})


COMMON = ["--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]


def start_pd():
    kv_port = free_port()
    # A small prefill batch, so a run of many requests is still being prefilled when the producer is killed.
    prefill = Server(SMOLLM2, "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--num-threads", "1",
                     "--kv-transfer-config", kv_config("kv_producer", kv_port, "prefill-0"))
    try:
        decode = Server(SMOLLM2, *COMMON, "--num-threads", "2",
                        "--kv-transfer-config", kv_config("kv_consumer", kv_port, "decode-0"))
    except Exception:
        prefill.stop()
        raise
    deadline = time.time() + 20  # the consumer connects to the producer in the background
    while time.time() < deadline:
        if prefill.metric("atomc:kv_transfer_peers") == 1 and decode.metric("atomc:kv_transfer_peers") == 1:
            break
        time.sleep(0.1)
    else:
        raise RuntimeError("the KV connection did not come up: " + decode.read_log())
    status, h = decode.json("GET", "/health")
    assert h["kv_transfer"] == {"kv_role": "kv_consumer", "engine_id": "decode-0"}
    proxy = Proxy(prefill.base, decode.base)
    return prefill, decode, proxy


def wait_blocks_free(srv, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = srv.metrics()
        total = sum(v for k, v in m.items() if k.startswith("atomc:num_kv_blocks"))
        free = sum(v for k, v in m.items() if k.startswith("atomc:num_free_kv_blocks"))
        held = sum(v for k, v in m.items() if k.startswith("atomc:kv_transfer_held_blocks"))
        if total and free == total and held == 0:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def reference():
    ps = prompts(200)
    srv = Server(SMOLLM2, *COMMON, "--num-threads", "2")
    try:
        ref = run_all(srv.port, ps)
        chat_ref = [chat(srv.port, i, stream=False) for i in range(3)]
    finally:
        srv.stop()
    return ps, ref, chat_ref


def chat(port, i, stream):
    body = {"messages": [{"role": "user", "content": f"Name {i + 2} colours."}], "max_tokens": 8, "temperature": 0,
            "stream": stream}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    if not stream:
        j = json.loads(r.read())
        conn.close()
        return j["choices"][0]["message"]["content"]
    text = ""
    for line in r.read().decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ch = json.loads(line[6:])["choices"]
            if ch and ch[0]["delta"].get("content"):
                text += ch[0]["delta"]["content"]
    conn.close()
    return text


def test_pd_matches_single_instance(reference):
    ps, ref, chat_ref = reference
    prefill, decode, proxy = start_pd()
    try:
        got = run_all(proxy.port, ps)
        assert got == ref
        assert [chat(proxy.port, i, stream=True) for i in range(3)] == chat_ref
        n_req = len(ps) + len(chat_ref)
        p = prefill.metric
        assert decode.metric("atomc:kv_transfer_fallbacks_total") == 0
        assert decode.metric("atomc:kv_transfers_received_total") == n_req
        # The decode instance ran exactly one prompt token per request: the last.
        assert decode.metric("atomc:prompt_tokens_computed_total") == n_req
        assert p("atomc:kv_transfers_sent_total") == n_req
        prompt_tokens = sum(r[3] for r in ref)
        chat_prompt_tokens = decode.metric("vllm:prompt_tokens_total") - prompt_tokens
        kv_bytes = (prompt_tokens + chat_prompt_tokens) * KV_TOKEN_BYTES
        print(f"{n_req} requests, {prompt_tokens + chat_prompt_tokens:.0f} prompt tokens, {kv_bytes:.0f} KV bytes")
        # Leading blocks the decode instance had cached from earlier prompts (its HAVE answer to the
        # producer's QUERY) are not sent: every other prompt token's KV is, exactly once.
        skipped = p("atomc:kv_transfer_blocks_skipped_total")
        assert decode.metric("atomc:kv_transfer_blocks_skipped_total") == skipped
        print(f"{skipped:.0f} blocks skipped (cached on the decode instance)")
        assert p("atomc:kv_transfer_bytes_sent_total") == kv_bytes - skipped * 16 * KV_TOKEN_BYTES
        assert decode.metric("atomc:kv_transfer_bytes_received_total") == kv_bytes - skipped * 16 * KV_TOKEN_BYTES
        assert p("atomc:kv_transfer_blocks_sent_total") == decode.metric("atomc:kv_transfer_blocks_received_total")
        # Per-layer sends: one DATA frame per layer per step that computed prompt tokens; the copy
        # thread queues frames while the forward that wrote them still runs.
        layers, early = p("atomc:kv_transfer_layers_sent_total"), p("atomc:kv_transfer_layers_during_forward_total")
        print(f"layer frames {layers:.0f}, {early:.0f} queued during their forward ({early / layers:.0%})")
        assert layers % 30 == 0 and layers >= 30 * n_req
        assert early > 0
        assert wait_blocks_free(prefill), prefill.metrics()
        assert wait_blocks_free(decode), decode.metrics()
        pm = proxy.metrics()
        assert pm["atomc_proxy:local_prefill_total"] == 0 and pm["atomc_proxy:errors_total"] == 0
    finally:
        proxy.stop()
        decode.stop()
        prefill.stop()


def test_pd_survives_producer_death(reference):
    ps, ref, _ = reference
    ps, ref = ps[:120], ref[:120]
    prefill, decode, proxy = start_pd()
    try:
        done = []
        lock = threading.Lock()

        def one(p):
            r = complete(proxy.port, p, 4)
            with lock:
                done.append(1)
            return r

        with concurrent.futures.ThreadPoolExecutor(200) as ex:
            futs = [ex.submit(one, p) for p in ps]
            deadline = time.time() + 300
            while prefill.metric("atomc:kv_transfers_sent_total") < 30 and time.time() < deadline:
                time.sleep(0.01)
            done_at_kill = len(done)
            prefill.proc.send_signal(signal.SIGKILL)  # mid-run: transfers and prefills in flight die
            prefill.proc.wait()
            got = [f.result() for f in futs]
        assert got == ref
        pm = proxy.metrics()
        print(f"killed after {done_at_kill} of {len(ps)} done; proxy: local prefills "
              f"{pm['atomc_proxy:local_prefill_total']:.0f}, prefill failovers {pm['atomc_proxy:prefill_failovers_total']:.0f};"
              f" decode: transfers {decode.metric('atomc:kv_transfers_received_total'):.0f}, fallbacks "
              f"{decode.metric('atomc:kv_transfer_fallbacks_total'):.0f}")
        assert pm["atomc_proxy:local_prefill_total"] > 0
        assert pm["atomc_proxy:errors_total"] == 0
        assert done_at_kill < len(ps)  # killed mid-run
        assert decode.metric("atomc:kv_transfers_received_total") >= 30 - 8
        assert wait_blocks_free(decode), decode.metrics()
        assert decode.metric("atomc:kv_transfer_waiting_requests") == 0
    finally:
        proxy.stop()
        decode.stop()
        if prefill.proc.poll() is None:
            prefill.stop()
        else:
            prefill.log.close()


def test_bad_kv_transfer_config_fails_startup():
    for cfg, word in (('{"kv_role":"kv_sender"}', "kv_role"), ('{"kv_role":"kv_producer","kv_connector":"Nixl"}',
                                                                "Nixl"), ("[1]", "JSON object")):
        r = subprocess.run([ATOMC_BIN, "serve", "--model", SMOLLM2, "--port", "0", "--kv-transfer-config", cfg],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and word in r.stderr, (cfg, r.stderr)


def test_kv_transfer_params_need_a_configured_instance():
    srv = Server(SMOLLM2, "--num-threads", "1")
    try:
        status, body = srv.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                             "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 400 and "--kv-transfer-config" in body["error"]["message"]
        status, body = srv.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                             "kv_transfer_params": {"do_remote_prefill": True}})
        assert status == 400 and "remote_request_id" in body["error"]["message"]
        status, body = srv.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                             "kv_transfer_params": "yes"})
        assert status == 400
        # Without a remote prefill or decode the params change nothing (vLLM passes empty ones).
        status, body = srv.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "temperature": 0,
                                                             "kv_transfer_params": {"do_remote_decode": False}})
        assert status == 200
    finally:
        srv.stop()


def test_unclaimed_late_and_aborted_transfers_free_blocks():
    """Without the proxy: a prefill whose decode request never comes (the producer's held blocks are
    freed after hold_timeout_s), a decode request whose KV never comes (prefilled locally after
    timeout_s, same tokens as a plain request), and one aborted by its client while it waits."""
    kv_port = free_port()
    extra = {"timeout_s": 2, "hold_timeout_s": 3}

    def cfg(role, eid):
        return json.dumps({"kv_role": role, "kv_port": kv_port,
                           "kv_connector_extra_config": dict(extra, engine_id=eid)})

    prefill = Server(SMOLLM2, "--num-threads", "1", "--kv-transfer-config", cfg("kv_producer", "p"))
    decode = Server(SMOLLM2, "--num-threads", "1", "--kv-transfer-config", cfg("kv_consumer", "d"))
    try:
        deadline = time.time() + 20
        while decode.metric("atomc:kv_transfer_peers") != 1 and time.time() < deadline:
            time.sleep(0.1)
        prompt = " ".join(WORDS * 3)
        status, body = prefill.json("POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "remote_engine_id": "d"}})
        assert status == 200, body
        kv = body["kv_transfer_params"]
        assert kv["do_remote_prefill"] and kv["remote_engine_id"] == "p" and kv["remote_request_id"]
        # Held until the consumer acknowledges. (The stats are a snapshot taken at the end of the
        # engine step that answered, which may come just after the response: poll briefly.)
        deadline = time.time() + 1
        while prefill.metric("atomc:kv_transfer_held_blocks") == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert prefill.metric("atomc:kv_transfer_held_blocks") > 0
        assert wait_blocks_free(prefill, timeout=15), prefill.metrics()

        # KV that never comes: local prefill after timeout_s, the same answer as without P/D.
        plain = decode.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0})[1]
        t0 = time.time()
        status, late = decode.json("POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": 5, "temperature": 0,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": "never", "remote_engine_id": "p"}})
        assert status == 200 and time.time() - t0 >= 1.5
        assert late["choices"][0]["text"] == plain["choices"][0]["text"]
        assert decode.metric("atomc:kv_transfer_fallbacks_total") == 1

        # Aborted while waiting for its KV: nothing stays behind.
        with pytest.raises(OSError):
            decode.request("POST", "/v1/completions", {
                "prompt": prompt, "max_tokens": 5,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": "never-2"}}, timeout=0.5)
        deadline = time.time() + 10
        while decode.metric("atomc:kv_transfer_waiting_requests") != 0 and time.time() < deadline:
            time.sleep(0.05)
        assert decode.metric("atomc:kv_transfer_waiting_requests") == 0
        assert decode.metric("vllm:request_success_total", finished_reason="abort") == 1
        assert decode.metric("atomc:kv_transfer_fallbacks_total") == 1
        assert wait_blocks_free(decode), decode.metrics()
    finally:
        decode.stop()
        prefill.stop()
