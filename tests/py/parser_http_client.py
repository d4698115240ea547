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


if __name__ == "__main__":
    {"harmony": mode_harmony, "qwen3": mode_qwen3}[MODE]()
    print(f"parser_http_client {MODE}: ok")
