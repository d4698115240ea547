"""Client half of tests/test_parser_http.c (not a pytest module): the official SDKs against a
real atomc server whose fake "echo" engine generates the last user message verbatim, so each
request scripts the model output. Exits non-zero (assertion message on stderr) on a mismatch.

usage: python3 parser_http_client.py PORT MODE   (MODE: harmony | qwen3 | anthropic)
"""
import json
import sys

PORT, MODE = int(sys.argv[1]), sys.argv[2]
BASE = f"http://127.0.0.1:{PORT}"

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"location": {"type": "string"}},
                                                           "required": ["location"]}}}]

HARMONY_FINAL = ("<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need weather for Tokyo.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                "{\"location\":\"Tokyo\"}<|call|>")
QWEN3_CALL = ("<think>\nThe user wants Paris weather.\n</think>\n\n<tool_call>\n"
              "{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}\n</tool_call>")
QWEN3_TEXT = "<think>\nEasy.\n</think>\n\nHello there!"


def openai_client():
    import openai
    return openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0)


def chat(client, script, tools=None, stream=False):
    kw = {"model": "echo", "messages": [{"role": "user", "content": script}], "max_tokens": 2000}
    if tools:
        kw["tools"] = tools
    if not stream:
        return client.chat.completions.create(**kw)
    reasoning, content, calls, finish, n_chunks = "", "", {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        n_chunks += 1
        ch = chunk.choices[0]
        d = ch.delta
        extra = d.model_extra or {}
        reasoning += extra.get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    assert n_chunks > 5, n_chunks  # the output really was streamed in pieces
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def check_case(client, script, tools, want_reasoning, want_content, want_calls):
    r = chat(client, script, tools)
    msg = r.choices[0].message
    extra = msg.model_extra or {}
    assert extra.get("reasoning_content") == want_reasoning, (extra, want_reasoning)
    assert (msg.content or "") == want_content, (msg.content, want_content)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    assert got == want_calls, got
    assert all(c.id.startswith("chatcmpl-tool-") for c in msg.tool_calls or [])
    assert r.choices[0].finish_reason == ("tool_calls" if want_calls else "stop"), r.choices[0].finish_reason
    reasoning, content, calls, finish = chat(client, script, tools, stream=True)
    assert reasoning == want_reasoning, (reasoning, want_reasoning)
    # Streamed, whitespace around calls arrives as content (it cannot be known to precede a call).
    assert (content.strip() if want_calls else content) == want_content, (content, want_content)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want_calls, calls
    assert finish == ("tool_calls" if want_calls else "stop"), finish


def mode_harmony():
    c = openai_client()
    check_case(c, HARMONY_FINAL, None, "User asks 2+2. Simple.", "2 + 2 = 4.", [])
    check_case(c, HARMONY_CALL, TOOLS, "Need weather for Tokyo.", "", [("get_weather", {"location": "Tokyo"})])


def mode_qwen3():
    c = openai_client()
    check_case(c, QWEN3_TEXT, None, "\nEasy.\n", "\n\nHello there!", [])
    check_case(c, QWEN3_CALL, TOOLS, "\nThe user wants Paris weather.\n", "",
               [("get_weather", {"location": "Paris"})])


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "weather of a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


def anthropic_case(ac, script, want_thinking, want_text, want_calls):
    """The Messages API over the same parsers: thinking / text / tool_use blocks, streamed and not."""
    kw = {"model": "echo", "max_tokens": 2000, "tools": ANTHROPIC_TOOLS,
          "messages": [{"role": "user", "content": script}]}
    m = ac.messages.create(**kw)
    kinds = [b.type for b in m.content]
    want_kinds = (["thinking"] if want_thinking else []) + (["text"] if want_text else []) + ["tool_use"] * len(want_calls)
    assert kinds == want_kinds, (kinds, m.content)
    thinking = "".join(b.thinking for b in m.content if b.type == "thinking")
    text = "".join(b.text for b in m.content if b.type == "text")
    calls = [(b.name, b.input) for b in m.content if b.type == "tool_use"]
    assert (thinking, text, calls) == (want_thinking, want_text, want_calls), (thinking, text, calls)
    assert all(b.id.startswith("toolu_") for b in m.content if b.type == "tool_use")
    assert m.stop_reason == ("tool_use" if want_calls else "end_turn"), m.stop_reason
    events = list(ac.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    assert events[-2].delta.stop_reason == m.stop_reason
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == want_kinds, starts
    assert [e.index for e in starts] == list(range(len(starts)))
    assert types.count("content_block_stop") == len(starts)
    s_thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                         and e.delta.type == "thinking_delta")
    s_text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    s_json = [json.loads(e.delta.partial_json) for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert s_thinking == want_thinking and (s_text.rstrip() if want_calls else s_text) == want_text, (s_thinking, s_text)
    assert [(e.content_block.name, j) for e, j in zip([x for x in starts if x.content_block.type == "tool_use"],
                                                       s_json)] == want_calls
    with ac.messages.stream(**kw) as st:  # the SDK's own assembly of the event stream
        final = st.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == want_calls


def mode_anthropic():
    import anthropic
    ac = anthropic.Anthropic(base_url=BASE, api_key="none", max_retries=0)
    anthropic_case(ac, QWEN3_CALL, "\nThe user wants Paris weather.\n", "", [("get_weather", {"location": "Paris"})])
    anthropic_case(ac, QWEN3_TEXT, "\nEasy.\n", "Hello there!", [])
    anthropic_case(ac, "Let me look.<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Rome\"}}"
                   "</tool_call>", "", "Let me look.", [("get_weather", {"location": "Rome"})])


def mode_anthropic_harmony():
    import anthropic
    ac = anthropic.Anthropic(base_url=BASE, api_key="none", max_retries=0)
    anthropic_case(ac, HARMONY_CALL, "Need weather for Tokyo.", "", [("get_weather", {"location": "Tokyo"})])
    anthropic_case(ac, HARMONY_FINAL, "User asks 2+2. Simple.", "2 + 2 = 4.", [])


if __name__ == "__main__":
    {"harmony": mode_harmony, "qwen3": mode_qwen3, "anthropic": mode_anthropic,
     "anthropic_harmony": mode_anthropic_harmony}[MODE]()
    print(f"parser_http_client {MODE}: ok")
