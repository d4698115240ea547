"""`atomc serve` end to end with SmolLM2-135M-Instruct ($ATOMC_SMOLLM2) through the official
`openai` client and raw HTTP: completions and chat, streaming and not, n>1, prompt lists and
token ids, stop strings, logprobs (incl. echo prompt logprobs), usage, every error class,
auth, /tokenize, /detokenize, /apply-template, /metrics, client disconnect -> abort.
The server's greedy tokens are checked against HF-derived references
(tests/fixtures/models/smollm2_refs.json)."""
import json
import math
import os
import socket
import time

import pytest

from server_util import SMOLLM2, Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.skipif(not SMOLLM2, reason="set ATOMC_SMOLLM2 to the SmolLM2-135M-Instruct GGUF")

KEY = "test-key-123"
MAX_LEN = 1024
REFS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "smollm2_refs.json")


@pytest.fixture(scope="module")
def srv():
    s = Server(SMOLLM2, "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8", "--served-model-name", "smol",
               "alias", "--max-n", "8", api_key=KEY)
    yield s
    assert s.stop() == 0, s.read_log()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.base}/v1", api_key=KEY, max_retries=0, timeout=120)


def greedy(client, prompt, n_tokens, **kw):
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=n_tokens, temperature=0, **kw)
    return r


# ---------------------------------------------------------------- basics

def test_health_models_version(srv, client):
    assert srv.request("GET", "/health")[0] == 200
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["smol", "alias"]
    assert models.data[0].max_model_len == MAX_LEN
    assert client.models.retrieve("alias").id == "alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    st, body = srv.json("GET", "/version")
    assert st == 200 and body["version"]


def test_completion_non_stream_usage_matches_tokenize(srv, client):
    prompt = "The capital of France is"
    r = greedy(client, prompt, 8)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "smol"
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].finish_reason in ("stop", "length")
    st, tok = srv.json("POST", "/tokenize", {"model": "smol", "prompt": prompt})
    assert st == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_LEN
    assert r.usage.prompt_tokens == tok["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 8
    assert len(r.choices[0].text) > 0


def test_greedy_tokens_match_reference(srv, client):
    assert os.path.exists(REFS), "committed fixture tests/fixtures/models/smollm2_refs.json is missing"
    refs = json.load(open(REFS))
    checked = 0
    for p in refs["prompts"]:
        if p.get("kind") != "plain":
            continue
        # Compare only while the reference's top-2 margin is clear (Q4 rounding may flip near-ties).
        n = 0
        while n < len(p["greedy"]) and p["greedy_margins"][n] > 0.5:
            n += 1
        if n == 0:
            continue
        r = client.completions.create(model="smol", prompt=p["ids"], max_tokens=n, temperature=0, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        got = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
        assert got == p["greedy"][:n], p["text"]
        checked += 1
    assert checked > 0


def test_stream_equals_non_stream(client):
    prompt = "Once upon a time"
    full = greedy(client, prompt, 24).choices[0]
    chunks = list(client.completions.create(model="smol", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and not chunks[-1].choices
    assert usage[0].completion_tokens <= 24


def test_token_id_prompt_equals_text_prompt(srv, client):
    prompt = "Water boils at"
    st, tok = srv.json("POST", "/tokenize", {"prompt": prompt})
    a = greedy(client, prompt, 10).choices[0].text
    b = greedy(client, tok["tokens"], 10).choices[0].text
    assert a == b


def test_prompt_list_and_n_give_indexed_choices(srv, client):
    r = client.completions.create(model="smol", prompt=["Hello", "The sky is"], max_tokens=4, n=2, temperature=0.8,
                                  seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    # Prompt tokens count once per prompt (not per choice); completion tokens sum over choices.
    n_prompt = sum(srv.json("POST", "/tokenize", {"prompt": p})[1]["count"] for p in ["Hello", "The sky is"])
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 4 * 4
    # Greedy with n=2: both choices identical.
    g = client.completions.create(model="smol", prompt="Hello", max_tokens=6, n=2, temperature=0)
    assert g.choices[0].text == g.choices[1].text
    # Token-id lists: one choice per list.
    t = client.completions.create(model="smol", prompt=[[504, 3575], [504]], max_tokens=2, temperature=0)
    assert len(t.choices) == 2


def test_seed_reproducible(client):
    a = client.completions.create(model="smol", prompt="Tell me", max_tokens=12, temperature=1.0, seed=1234)
    b = client.completions.create(model="smol", prompt="Tell me", max_tokens=12, temperature=1.0, seed=1234)
    assert a.choices[0].text == b.choices[0].text


def test_stop_string_cuts_text(client):
    base = greedy(client, "1, 2, 3, 4,", 16, extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 4
    stop = base[2:4]
    cut = base[: base.index(stop)]
    r = greedy(client, "1, 2, 3, 4,", 16, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert r.finish_reason == "stop" and r.text == cut
    r2 = greedy(client, "1, 2, 3, 4,", 16, stop=stop,
                extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert r2.text == cut + stop


def test_max_tokens_length_finish(client):
    r = greedy(client, "Count: one two three", 5, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_completion_logprobs_shape(client):
    r = greedy(client, "The weather today", 6, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert l <= 0 and 1 <= len(top) <= 4
        assert tok in top
        assert l >= max(top.values()) - 1e-4  # greedy: the chosen token is the most likely
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-4
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_prompt_logprobs_max_tokens_zero(srv, client):
    """lm-eval-harness loglikelihood: echo + logprobs + max_tokens 0."""
    prompt = "Paris is the capital of France"
    st, tok = srv.json("POST", "/tokenize", {"prompt": prompt})
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == prompt
    lp = c.logprobs
    assert len(lp.tokens) == tok["count"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert r.usage.completion_tokens == 0
    # The same logprob for a continuation token whether scored as prompt or generated greedily.
    g = greedy(client, prompt, 1, logprobs=1, echo=True)
    assert len(g.choices[0].logprobs.tokens) == tok["count"] + 1
    assert g.choices[0].logprobs.token_logprobs[1] == pytest.approx(lp.token_logprobs[1], abs=1e-3)


# ---------------------------------------------------------------- chat

MSGS = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"}]


def test_chat_non_stream_and_stream(srv, client):
    r = client.chat.completions.create(model="smol", messages=MSGS, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    m = r.choices[0].message
    assert m.role == "assistant" and len(m.content) > 0
    st, tmpl = srv.json("POST", "/apply-template", {"messages": MSGS})
    assert st == 200 and "What is the capital of France?" in tmpl["prompt"]
    st, tok = srv.json("POST", "/tokenize", {"messages": MSGS})
    assert r.usage.prompt_tokens == tok["count"]
    chunks = list(client.chat.completions.create(model="smol", messages=MSGS, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == m.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(model="smol", messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == r.usage.completion_tokens // 2
        for e in content:
            assert e.logprob <= 0 and len(e.top_logprobs) == 2 and isinstance(e.bytes, list)
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob


def test_chat_content_parts_and_max_completion_tokens(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Say hi"}]}], max_completion_tokens=3, temperature=0,
        extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- errors

def err(srv, path, body, status, part=None, param=None, headers=None, method="POST"):
    st, hdrs, data = srv.request(method, path, body, headers=headers)
    assert st == status, data
    j = json.loads(data)
    e = j["error"]
    assert set(e) >= {"message", "type", "param", "code"}
    if part:
        assert part in e["message"], e["message"]
    if param:
        assert e["param"] == param
    return e


def test_bad_requests_get_400(srv):
    C = "/v1/completions"
    err(srv, C, {"prompt": "x", "bogus_field": 1}, 400, "bogus_field", "bogus_field")
    err(srv, C, {"prompt": "x", "temperature": "hot"}, 400, None, "temperature")
    err(srv, C, {"prompt": "x", "temperature": -1}, 400, None, "temperature")
    err(srv, C, {"prompt": "x", "top_p": 0}, 400, None, "top_p")
    err(srv, C, {"prompt": "x", "n": 0}, 400, None, "n")
    err(srv, C, {"prompt": "x", "n": 10 ** 9}, 400, None, "n")
    err(srv, C, {"prompt": "x", "logprobs": 50}, 400, None, "logprobs")
    err(srv, C, {"prompt": [10 ** 8]}, 400, "out of range", "prompt")
    err(srv, C, {"prompt": "x", "stop_token_ids": [-3]}, 400, None, "stop_token_ids")
    err(srv, C, b'{"prompt": "x", "temperature": NaN}', 400, "invalid JSON")
    err(srv, C, b'{"prompt": "x", ', 400, "invalid JSON")
    err(srv, C, b'{"prompt": "\xff\xfe"}', 400, "invalid JSON")
    err(srv, C, b"[" * 50000 + b"]" * 50000, 400)
    err(srv, C, b"", 400, "empty")
    err(srv, C, {"prompt": "x", "max_tokens": 10 ** 7}, 400, "maximum context length")
    err(srv, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, None, "messages")
    err(srv, "/v1/chat/completions", {"messages": MSGS, "tool_choice": "required"}, 400, None, "tool_choice")
    err(srv, "/detokenize", {"tokens": [10 ** 8]}, 400)


def test_prompt_over_context_names_both_numbers(srv):
    long_prompt = "hello " * 3000
    e = err(srv, "/v1/completions", {"prompt": long_prompt, "max_tokens": 5}, 400, "maximum context length")
    st, tok = srv.json("POST", "/tokenize", {"prompt": long_prompt})
    assert str(MAX_LEN) in e["message"] and str(tok["count"]) in e["message"]
    e = err(srv, "/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, "maximum context length")
    assert str(MAX_LEN) in e["message"]


def test_not_found_method_auth_size(srv, client):
    err(srv, "/v1/nothing", {"prompt": "x"}, 404)
    err(srv, "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "gpt-4", "model")
    st, hdrs, _ = srv.request("GET", "/v1/completions")
    assert st == 405 and hdrs.get("Allow") == "POST"
    err(srv, "/v1/completions", {"prompt": "x"}, 401, headers={"Content-Type": "application/json"})
    err(srv, "/v1/completions", {"prompt": "x"}, 401,
        headers={"Content-Type": "application/json", "Authorization": "Bearer wrong"})
    bad = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="smol", prompt="x", max_tokens=1)
    # Open endpoints need no key.
    assert srv.request("GET", "/health", auth=False)[0] == 200
    assert srv.request("GET", "/metrics", auth=False)[0] == 200
    # A body over the limit (32 MiB) is refused from its Content-Length, before it is read.
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(40 << 20).encode() + b"\r\n\r\n" + b'{"prompt":"' + b"a" * 65536)
    assert s.recv(4096).split(b" ")[1] == b"413"
    s.close()
    # Headers over the limit (64 KiB) are refused too.
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (100 << 10) + b"\r\n\r\n")
    reply = s.recv(4096)
    assert reply == b"" or reply.split(b" ")[1] in (b"400", b"413", b"431")
    s.close()
    # Still serving.
    assert greedy(client, "ok", 1).choices[0].text is not None


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="smol", prompt="x", max_tokens=5, temperature=-2)
    assert "temperature" in str(ei.value)


def test_invalid_stream_options_and_best_of(srv):
    err(srv, "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, None,
        "stream_options")
    err(srv, "/v1/completions", {"prompt": "x", "best_of": 3}, 400, None, "best_of")


# ---------------------------------------------------------------- tokenizer endpoints, metrics

def test_tokenize_detokenize_roundtrip(srv):
    text = "Hello, world! Ünïcödé ✓"
    st, tok = srv.json("POST", "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert st == 200 and len(tok["token_strs"]) == tok["count"]
    st, de = srv.json("POST", "/detokenize", {"tokens": tok["tokens"]})
    assert st == 200 and de["prompt"] == text


def test_metrics_names(srv, client):
    greedy(client, "metrics", 2)
    m = srv.metrics()
    names = {k.split("{")[0] for k in m}
    for n in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
              "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
              "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]:
        assert n in names, n
    assert srv.metric("vllm:generation_tokens_total") >= 2
    assert srv.metric("vllm:request_success_total", finished_reason="length") >= 1
    assert srv.metric("vllm:request_queue_time_seconds_count") >= 1  # from the engine's timestamps
    assert srv.metric("vllm:time_to_first_token_seconds_count") >= 1
    assert srv.metric("vllm:e2e_request_latency_seconds_sum") > 0
    assert all('model_name="smol"' in k for k in m if k.startswith("vllm:"))


def test_openapi_document(srv):
    st, doc = srv.json("GET", "/openapi.json")
    assert st == 200 and doc["openapi"].startswith("3.")
    for p in ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
              "/detokenize", "/apply-template"]:
        assert p in doc["paths"]


# ---------------------------------------------------------------- disconnect

def test_client_disconnect_mid_stream_aborts(srv):
    before = srv.metric("vllm:request_success_total", finished_reason="abort")
    body = json.dumps({"model": "smol", "prompt": "Write a very long story about a dragon.", "max_tokens": 900,
                       "stream": True, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
              b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    s.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        if srv.metric("vllm:request_success_total", finished_reason="abort") > before and \
                srv.metric("vllm:num_requests_running") == 0 and srv.metric("vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert srv.metric("vllm:request_success_total", finished_reason="abort") == before + 1
    assert srv.metric("vllm:num_requests_running") == 0
    assert srv.metric("vllm:kv_cache_usage_perc") == 0


def test_echo_of_partial_utf8_token_ids_is_valid_json(srv, client):
    """Token ids that end inside a UTF-8 character still give valid JSON (U+FFFD for the cut bytes)."""
    st, tok = srv.json("POST", "/tokenize", {"prompt": "✓", "add_special_tokens": False})
    assert st == 200 and tok["count"] >= 2, tok  # byte-level pieces of a 3-byte character
    r = client.completions.create(model="smol", prompt=tok["tokens"][:1], max_tokens=1, echo=True, temperature=0)
    assert r.choices[0].text.startswith("\ufffd")
