"""Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) with SmolLM2-135M-Instruct
($ATOMC_SMOLLM2) through the official `anthropic` Python SDK. The reference for what the model
says is the server's own OpenAI chat endpoint: the same conversation sent both ways at
temperature 0 must give the same text and the same prompt token count (so system prompts,
system blocks, tool_use / tool_result history and tool definitions are translated to what the
chat template would get from an OpenAI client). Streaming events are checked in order and
against the non-streamed message; stop_sequences, max_tokens, top_k and every class of bad input
(Anthropic's error shape, the SDK's exception classes) are covered. Tool-use output (the model
calling a tool) is covered with scripted output in tests/test_parser_http.c."""
import json

import pytest

from server_util import SMOLLM2, Server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.skipif(not SMOLLM2, reason="set ATOMC_SMOLLM2 to the SmolLM2-135M-Instruct GGUF")

KEY = "anthropic-key-1"
MODEL = "smol"

TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def srv():
    s = Server(SMOLLM2, "--max-model-len", "1024", "--max-num-seqs", "4", "--served-model-name", MODEL,
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes", api_key=KEY)
    yield s
    assert s.stop() == 0, s.read_log()


@pytest.fixture(scope="module")
def ac(srv):
    return anthropic.Anthropic(base_url=srv.base, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oc(srv):
    return openai.OpenAI(base_url=f"{srv.base}/v1", api_key=KEY, max_retries=0, timeout=120)


def create(ac, **kw):
    """messages.create; the sampling fields this SDK no longer names go in the body as extra fields."""
    extra = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    return ac.messages.create(extra_body=extra or None, **kw)


def chat_ref(oc, messages, max_tokens, **kw):
    r = oc.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason


def text_of(msg):
    assert all(b.type == "text" for b in msg.content), msg.content
    return "".join(b.text for b in msg.content)


def test_message_matches_chat_completions(ac, oc):
    m = create(ac, model=MODEL, max_tokens=24, temperature=0, system="You are a helpful assistant.",
                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    ref, ptoks, ctoks, finish = chat_ref(oc, [{"role": "system", "content": "You are a helpful assistant."},
                                              {"role": "user", "content": "What is the capital of France?"}], 24)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL
    assert text_of(m) == ref and ref
    assert m.usage.input_tokens == ptoks and m.usage.output_tokens == ctoks
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
    assert m.stop_sequence is None


def test_system_blocks_and_content_blocks_equal_strings(ac):
    a = create(ac, model=MODEL, max_tokens=16, temperature=0, system="Be brief.",
                           messages=[{"role": "user", "content": "Name a color."}])
    b = create(ac, model=MODEL, max_tokens=16, temperature=0,
                           system=[{"type": "text", "text": "Be brief."}],
                           messages=[{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}])
    assert text_of(a) == text_of(b)
    assert a.usage.input_tokens == b.usage.input_tokens


def test_multi_turn_matches_chat(ac, oc):
    msgs = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a fact about cats."}]
    m = create(ac, model=MODEL, max_tokens=20, temperature=0, messages=msgs)
    ref, ptoks, _, _ = chat_ref(oc, msgs, 20)
    assert text_of(m) == ref
    assert m.usage.input_tokens == ptoks


def test_stream_events_and_text_equal_non_stream(ac):
    kw = dict(model=MODEL, max_tokens=20, temperature=0, messages=[{"role": "user", "content": "Write a haiku."}])
    whole = create(ac, **kw)
    events = list(create(ac, stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop" and types[-2] == "message_delta"
    assert types[1] == "content_block_start" and types[-3] == "content_block_stop"
    assert set(types[2:-3]) == {"content_block_delta"}
    assert len(types) > 6  # really streamed
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == text_of(whole)
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # The SDK's stream helper assembles the same message.
    extra = {"temperature": kw.pop("temperature")}
    with ac.messages.stream(extra_body=extra, **kw) as s:
        final = s.get_final_message()
    assert text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason


def test_stop_sequences_and_max_tokens(ac):
    kw = dict(model=MODEL, temperature=0, messages=[{"role": "user", "content": "Count from 1 to 20."}])
    full = text_of(create(ac, max_tokens=60, **kw))
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]
    m = create(ac, max_tokens=60, stop_sequences=[stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text_of(m) == full[:full.index(stop)]
    m = create(ac, max_tokens=3, **kw)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    # Streamed stop_sequence reaches message_delta.
    ev = list(create(ac, max_tokens=60, stop_sequences=[stop], stream=True, **kw))
    assert ev[-2].delta.stop_reason == "stop_sequence" and ev[-2].delta.stop_sequence == stop


def test_sampling_params_accepted(ac):
    m = create(ac, model=MODEL, max_tokens=8, temperature=0.7, top_p=0.9, top_k=20,
                           messages=[{"role": "user", "content": "Say something."}])
    assert m.usage.output_tokens >= 1
    # top_k 1 is greedy whatever the temperature.
    a = create(ac, model=MODEL, max_tokens=12, temperature=1.0, top_k=1,
                           messages=[{"role": "user", "content": "Say something."}])
    b = create(ac, model=MODEL, max_tokens=12, temperature=0,
                           messages=[{"role": "user", "content": "Say something."}])
    assert text_of(a) == text_of(b)


def test_tool_use_round_trip_matches_chat(ac, oc):
    """tool definitions, an assistant tool_use and the user's tool_result render as the OpenAI
    equivalent (tools, assistant tool_calls, a tool message) does."""
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                      "content": [{"type": "text", "text": "18 C and sunny"}]}]},
    ]
    m = create(ac, model=MODEL, max_tokens=24, temperature=0, tools=TOOLS, messages=history)
    oai_msgs = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [{"id": "toolu_01", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"},
                                                                                      separators=(",", ":"))}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "18 C and sunny"},
    ]
    oai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                   "parameters": t["input_schema"]}} for t in TOOLS]
    r = oc.chat.completions.create(model=MODEL, messages=oai_msgs, tools=oai_tools, max_tokens=24, temperature=0)
    assert m.usage.input_tokens == r.usage.prompt_tokens
    blocks = [b for b in m.content if b.type == "text"]
    ref = r.choices[0].message.content or ""
    assert "".join(b.text for b in blocks).strip() == ref.strip()
    # The tool result really is in the prompt: without it the prompt is shorter.
    n_without = ac.messages.count_tokens(model=MODEL, tools=TOOLS, messages=history[:2] + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": ""}]}]).input_tokens
    assert n_without < m.usage.input_tokens


def test_count_tokens(ac, oc):
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    n = ac.messages.count_tokens(model=MODEL, system="sys", messages=msgs).input_tokens
    _, ptoks, _, _ = chat_ref(oc, [{"role": "system", "content": "sys"}] + msgs, 1)
    assert n == ptoks


def test_count_tokens_longer_than_the_context(ac, oc):
    # A count is not a generation: a conversation longer than --max-model-len (1024) is counted,
    # while /v1/messages refuses it with the context-length 400.
    msgs = [{"role": "user", "content": "word " * 1500}]
    n = ac.messages.count_tokens(model=MODEL, messages=msgs).input_tokens
    assert n > 1024
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model=MODEL, max_tokens=5, messages=msgs)


@pytest.mark.parametrize("body,part", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": []}, "messages"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "frobnicate"),
    ({"model": MODEL, "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
     "temperature"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "tool_use"),
    ({"model": MODEL, "max_tokens": 5, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]},
     "input_schema"),
    ({"model": MODEL, "max_tokens": 5, "tool_choice": {"type": "sometimes"},
      "messages": [{"role": "user", "content": "x"}]}, "tool_choice"),
    ({"model": MODEL, "max_tokens": 5, "stop_sequences": "END", "messages": [{"role": "user", "content": "x"}]},
     "stop_sequences"),
    ({"model": MODEL, "max_tokens": 100000, "messages": [{"role": "user", "content": "x"}]}, "context length"),
])
def test_bad_requests_get_anthropic_errors(srv, body, part):
    status, _, data = srv.request("POST", "/v1/messages", body)
    assert status == 400, data
    o = json.loads(data)
    assert o["type"] == "error" and o["error"]["type"] == "invalid_request_error", o
    assert part in o["error"]["message"], o


def test_sdk_exceptions(srv, ac):
    with pytest.raises(anthropic.BadRequestError) as ei:
        create(ac, model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert ei.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as ei:
        create(ac, model="claude-nonexistent", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "not_found_error"
    bad = anthropic.Anthropic(base_url=srv.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as ei:
        create(bad, model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["error"]["type"] == "authentication_error"
    # Malformed JSON.
    status, _, data = srv.request("POST", "/v1/messages", b"{not json")
    assert status == 400 and json.loads(data)["type"] == "error"
