"""`atomc serve` with --data-parallel-size 2 (two engine replicas behind one server, each request
to the replica with the fewest outstanding tokens) and with -tp 3 (SmolLM2's 9 heads over 3 ranks):
concurrent greedy completions equal the single-engine server's, /metrics sums both replicas, and
a bad data-parallel size is a clear startup failure. Needs ATOMC_SMOLLM2."""
import concurrent.futures
import subprocess
import time

import pytest

from server_util import ATOMC_BIN, SMOLLM2, Server

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fibonacci(n):",
           "The best thing about Mondays is", "Water boils at"]


def complete(srv, prompt):
    status, body = srv.json("POST", "/v1/completions",
                            {"model": srv.model_name, "prompt": prompt, "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def run_all(srv):
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(lambda p: complete(srv, p), PROMPTS))


def served_name():
    return SMOLLM2.rstrip("/").split("/")[-1]


@pytest.mark.skipif(not SMOLLM2, reason="set ATOMC_SMOLLM2")
def test_data_parallel_and_tensor_parallel_match_single_engine():
    ref_srv = Server(SMOLLM2, "--num-threads", "2")
    ref_srv.model_name = served_name()
    try:
        ref = run_all(ref_srv)
    finally:
        ref_srv.stop()
    for extra in (["-dp", "2"], ["-tp", "3"]):
        srv = Server(SMOLLM2, "--num-threads", "2", *extra)
        srv.model_name = served_name()
        try:
            got = run_all(srv)
            assert got == ref, extra
            # Replicas publish their counters after the step that finished a request, which can come
            # after the response went out: the total must reach the tokens generated (within 5 s).
            want, val = sum(n for _, n in ref), None
            for _ in range(50):
                metrics = srv.request("GET", "/metrics")[2].decode()
                gen = [l for l in metrics.splitlines() if l.startswith("vllm:generation_tokens_total")]
                val = float(gen[0].split()[-1]) if gen else None
                if val == want:
                    break
                time.sleep(0.1)
            assert val == want, (extra, val, want)
        finally:
            srv.stop()


def test_bad_data_parallel_size_fails_startup():
    if not SMOLLM2:
        pytest.skip("set ATOMC_SMOLLM2")
    r = subprocess.run([ATOMC_BIN, "serve", "--model", SMOLLM2, "--port", "0", "-dp", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "data parallel size 0" in r.stderr


@pytest.mark.skipif(not SMOLLM2, reason="set ATOMC_SMOLLM2")
def test_data_parallel_profiling_and_tokenizer_info(tmp_path):
    # The routed engine table must forward every engine function (profiling included) to a real
    # replica rather than calling it with the router's context.
    srv = Server(SMOLLM2, "--num-threads", "2", "-dp", "2", "--profile-dir", str(tmp_path / "p"))
    try:
        st, info = srv.json("GET", "/tokenizer_info")
        assert st == 200 and info["eos_token"] == "<|im_end|>"
        assert srv.json("POST", "/start_profile")[0] == 200
        st, _ = srv.json("POST", "/v1/completions", {"model": served_name(), "prompt": "Hi", "max_tokens": 2})
        assert st == 200
        st, body = srv.json("POST", "/stop_profile")
        assert st == 200 and body["trace"].startswith(str(tmp_path / "p"))
    finally:
        assert srv.stop() == 0
