"""`atomc bench serve` against a scripted streaming server with known timings."""
import json
import os
import socket
import subprocess
import sys

import pytest

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
HERE = os.path.dirname(__file__)
BENCH = ["bench", "serve"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stub():
    port = free_port()
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "sse_stub_server.py"), str(port), "60", "10"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    yield port
    p.kill()
    p.wait()


def bench(port, tmp_path, *args):
    cmd = [ATOMC, *BENCH, "--base-url", f"http://127.0.0.1:{port}", "--model", "stub",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r", "--disable-tqdm", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_measures_known_latencies(stub, tmp_path):
    bench(stub, tmp_path, "--num-prompts", "12", "--random-input-len", "20", "--random-output-len", "8",
          "--max-concurrency", "4", "--seed", "3")
    r = json.load(open(tmp_path / "r"))
    assert r["completed"] == 12 and r["failed"] == 0
    assert r["total_output_tokens"] == 12 * 8
    assert r["total_input_tokens"] == 12 * 20
    assert r["max_concurrency"] == 4 and r["max_concurrent_requests"] <= 4
    assert 55 <= r["median_ttft_ms"] <= 120, r["median_ttft_ms"]
    assert 9 <= r["median_tpot_ms"] <= 25, r["median_tpot_ms"]
    assert 9 <= r["median_itl_ms"] <= 25, r["median_itl_ms"]
    # e2e = ttft + 7 gaps
    assert 120 <= r["median_e2el_ms"] <= 260, r["median_e2el_ms"]
    for k in ("request_throughput", "output_throughput", "total_token_throughput", "p99_ttft_ms", "std_itl_ms"):
        assert k in r


def test_sweep_levels_and_goodput(stub, tmp_path):
    stdout = bench(stub, tmp_path, "--num-prompts", "8", "--random-input-len", "4", "--random-output-len", "4",
                   "--max-concurrency", "1,8", "--goodput", "ttft:30", "--seed", "1")
    r1 = json.load(open(tmp_path / "r-c1.json"))
    r8 = json.load(open(tmp_path / "r-c8.json"))
    assert r1["max_concurrent_requests"] == 1
    assert r8["max_concurrent_requests"] > 1
    assert r8["output_throughput"] > 2 * r1["output_throughput"]
    assert r1["request_goodput"] == 0  # every TTFT is ~60 ms > 30 ms SLO
    assert "concurrency" in stdout and "tok/s/user" in stdout


def test_counts_failures(tmp_path):
    port = free_port()
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "sse_stub_server.py"), str(port), "5", "1", "fail-odd"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        bench(port, tmp_path, "--num-prompts", "20", "--random-input-len", "4", "--random-output-len", "4",
              "--random-range-ratio", "0.5", "--max-concurrency", "5")
        r = json.load(open(tmp_path / "r"))
        assert r["completed"] + r["failed"] == 20
        assert r["failed"] > 0 and r["completed"] > 0
        assert all("HTTP 500" in e for e in r["errors"])
        assert all(n % 2 == 0 for n in r["output_lens"])
    finally:
        p.kill()
        p.wait()


def start_stub(*opts):
    port = free_port()
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "sse_stub_server.py"), str(port), "2", "1", *opts],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return port, p


def test_server_closing_connections_after_each_stream(tmp_path):
    # llama-server closes a kept-alive connection after each streamed response: every request sent
    # on a reused connection must be re-sent on a new one, not counted as failed.
    port, p = start_stub("close")
    try:
        bench(port, tmp_path, "--num-prompts", "12", "--random-input-len", "4", "--random-output-len", "3",
              "--random-vocab-size", "1000", "--max-concurrency", "2")
        r = json.load(open(tmp_path / "r"))
        assert r["completed"] == 12 and r["failed"] == 0, r["errors"]
        assert r["output_lens"] == [3] * 12
    finally:
        p.kill()
        p.wait()


def test_prompt_ids_from_the_served_vocabulary(tmp_path):
    # No --random-vocab-size: ids come from GET /tokenizer_info's vocab_size (the stub answers 400
    # for any id outside a 300-token vocabulary, as a server with a small vocabulary does).
    port, p = start_stub("vocab=300")
    try:
        cmd = [ATOMC, *BENCH, "--base-url", f"http://127.0.0.1:{port}", "--model", "stub", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "r", "--disable-tqdm", "--num-prompts", "10",
               "--random-input-len", "64", "--random-output-len", "2"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "[75, 300)" in out.stderr
        r = json.load(open(tmp_path / "r"))
        assert r["completed"] == 10 and r["failed"] == 0, r["errors"]
        # An explicit vocabulary larger than the server's fails every request: loudly, not zeros.
        out = subprocess.run(cmd + ["--random-vocab-size", "20000"], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0
        assert "every request failed" in out.stderr and "HTTP 400" in out.stderr
    finally:
        p.kill()
        p.wait()


def test_every_request_failing_is_an_error(tmp_path):
    port, p = start_stub("fail-all")
    try:
        out = subprocess.run([ATOMC, *BENCH, "--port", str(port), "--model", "m", "--num-prompts", "4",
                              "--random-input-len", "4", "--random-output-len", "2", "--random-vocab-size", "1000",
                              "--disable-tqdm"], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0
        assert "every request failed" in out.stderr and "HTTP 500" in out.stderr
    finally:
        p.kill()
        p.wait()


def test_rejects_bad_workload(stub):
    out = subprocess.run([ATOMC, *BENCH, "--port", str(stub), "--model", "m", "--random-vocab-size", "50"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "too small" in out.stderr


def test_bad_flags():
    out = subprocess.run([ATOMC, *BENCH, "--model", "m", "--max-concurrency", "x"], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "max-concurrency" in out.stderr
    out = subprocess.run([ATOMC, *BENCH], capture_output=True, text=True)
    assert out.returncode == 2 and "--model is required" in out.stderr


def test_plot_overlays_results(stub, tmp_path):
    bench(stub, tmp_path, "--num-prompts", "6", "--random-input-len", "4", "--random-output-len", "4",
          "--max-concurrency", "1,3", "--label", "engineA")
    other = tmp_path / "other"
    other.mkdir()
    for f in ("r-c1.json", "r-c3.json"):
        r = json.load(open(tmp_path / f))
        r["backend"] = "engineB"
        r["output_throughput"] *= 0.5
        json.dump(r, open(other / f, "w"))
    png = tmp_path / "chart.png"
    out = subprocess.run([sys.executable, os.path.join(HERE, "..", "..", "tools", "plot_bench.py"),
                          str(tmp_path / "r-c1.json"), str(tmp_path / "r-c3.json"), str(other), "-o", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.stat().st_size > 10000
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_text_prompts_from_a_tokenizer_and_chat_backend(stub, tmp_path):
    shared = os.environ.get("ATOMC_SHARED", os.path.join(HERE, "..", "..", "..", "shared"))
    tok = os.path.join(shared, "tokenizers", "llama3")
    if not os.path.exists(os.path.join(tok, "tokenizer.json")):
        pytest.skip("shared tokenizers not found")
    # Without a tokenizer, random prompts are ids: the chat backend refuses them clearly.
    out = subprocess.run([ATOMC, *BENCH, "--port", str(stub), "--model", "m", "--backend", "openai-chat",
                          "--num-prompts", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--tokenizer" in out.stderr
    bench(stub, tmp_path, "--backend", "openai-chat", "--tokenizer", tok, "--num-prompts", "6",
          "--random-input-len", "32", "--random-output-len", "5", "--max-concurrency", "3")
    r = json.load(open(tmp_path / "r"))
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_output_tokens"] == 30
    assert r["endpoint"] == "/v1/chat/completions"


def test_sharegpt_and_prefix_workloads(stub, tmp_path):
    conv = [{"conversations": [{"from": "human", "value": f"Question number {i}: tell me about the sea."},
                               {"from": "gpt", "value": "The sea is large. " * (i + 1)}]} for i in range(5)]
    conv.append({"conversations": [{"from": "human", "value": "only one turn"}]})  # unusable: skipped
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(conv))
    bench(stub, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "5",
          "--sharegpt-output-len", "3", "--max-concurrency", "5")
    r = json.load(open(tmp_path / "r"))
    assert r["completed"] == 5 and r["total_output_tokens"] == 15 and r["dataset_name"] == "sharegpt"
    out = subprocess.run([ATOMC, *BENCH, "--port", str(stub), "--model", "m", "--dataset-name", "sharegpt",
                          "--dataset-path", str(path), "--num-prompts", "6"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "only 5 usable conversations" in out.stderr
    bench(stub, tmp_path, "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "16",
          "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2",
          "--prefix-repetition-output-len", "2", "--num-prompts", "8")
    r = json.load(open(tmp_path / "r"))
    assert r["completed"] == 8 and r["total_input_tokens"] == 8 * 20
