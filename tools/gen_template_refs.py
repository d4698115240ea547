#!/usr/bin/env python3
"""Generate golden chat-template renderings for tests/test_template_golden.c.

References are rendered by Python jinja2 in the exact environment HF transformers builds
for chat templates (transformers.utils.chat_template_utils._compile_jinja_template:
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loopcontrols), its
tojson / raise_exception / strftime_now), with the variables apply_chat_template passes:
messages, tools, documents=None, add_generation_prompt, bos_token, eos_token, **kwargs.
continue_final_message is applied as transformers' render_jinja_template does it.

Messages are passed as given (atomc does not drop None-valued keys) except for HF's
reasoning aliasing (_alias_reasoning_fields: reasoning sent as reasoning_content, thinking
or reasoning is visible under reasoning_content and thinking); content given as a
list of text parts is joined with "\n" first unless the template walks the parts itself
(the same rule as src/template/chat_template.c, after vLLM's "string" content format).

Templates: Llama-3, Qwen3, DeepSeek-V3 (../shared/tokenizers/*/tokenizer_config.json;
gpt_oss and llama2 there carry no template) and SmolLM2 (tokenizer.chat_template of its
GGUF, read with the `gguf` package). Each template's text is committed next to its cases
so the C test needs neither the tokenizers folder nor the GGUF.

Usage: python3 tools/gen_template_refs.py [--tokenizers DIR] [--gguf PATH] [--out DIR]
"""
import argparse
import copy
import json
import os
import sys

from transformers.utils.chat_template_utils import _alias_reasoning_fields, _compile_jinja_template

import re

# A template walks list-of-parts content itself when it loops over a `...content` value
# or type-tests it (same pattern as src/template/chat_template.c, compiled with PCRE2).
PARTS_RE = re.compile(r"""for\s+\w+\s+in\s+[\w.\[\]'"]*content\b|content\s+is\s+(not\s+)?(string|iterable|sequence|mapping)""")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def token_text(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


def flatten(messages, template):
    if PARTS_RE.search(template):
        return messages
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        out.append(m)
    return out


def render(template, case, bos, eos):
    messages = _alias_reasoning_fields(flatten(copy.deepcopy(case["messages"]), template))
    kwargs = dict(case.get("kwargs") or {})
    variables = {}
    if bos is not None:
        variables["bos_token"] = bos
    if eos is not None:
        variables["eos_token"] = eos
    variables.update(kwargs)
    cont = case.get("continue_final_message", False)
    final = None
    if cont:
        last = messages[-1]
        c = last.get("content")
        if isinstance(c, list):
            for part in reversed(c):
                if "text" in part:
                    final = part["text"]
                    part["text"] = part["text"] + CONTINUE_TAG
                    break
        else:
            final = c
            last["content"] = c + CONTINUE_TAG
    compiled = _compile_jinja_template(template)
    out = compiled.render(messages=messages, tools=case.get("tools"), documents=None,
                          add_generation_prompt=case.get("add_generation_prompt", False), **variables)
    if cont:
        if final.strip() not in out or CONTINUE_TAG.strip() not in out:
            raise ValueError("continue_final_message: final message not in the rendered chat")
        loc = out.rindex(CONTINUE_TAG.strip())
        if out[loc:loc + len(CONTINUE_TAG)] == CONTINUE_TAG:
            out = out[:loc]
        else:
            out = out[:loc].rstrip()
    return out


SYS = "You are a helpful assistant."
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer", "default": 5},
            "safe": {"type": "boolean"}, "weight": {"type": "number"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "schedule", "description": "Schedule events (nested schema: arrays, oneOf, nullable, type lists).",
        "parameters": {"type": "object", "properties": {
            "events": {"type": "array", "items": {"type": "object", "properties": {
                "title": {"type": "string"}, "at": {"type": ["string", "null"]},
                "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["title"]}},
            "priority": {"oneOf": [{"type": "integer", "description": "1-5"}, {"type": "string", "enum": ["low", "high"]}]},
            "note": {"type": "string", "nullable": True, "default": None},
            "ratio": {"type": "number", "default": 0.25}},
            "required": ["events"]}}},
]


def call(name, args, cid="call_1"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def cases():
    u = lambda t: {"role": "user", "content": t}
    a = lambda t: {"role": "assistant", "content": t}
    s = lambda t: {"role": "system", "content": t}
    tool = lambda t, cid="call_1", name=None: dict({"role": "tool", "content": t, "tool_call_id": cid},
                                                   **({"name": name} if name else {}))
    weather_args = {"city": "Paris", "unit": "celsius"}
    C = []

    def add(name, messages, **kw):
        C.append(dict({"name": name, "messages": messages}, **kw))

    add("single_user", [u("Hello!")])
    add("single_user_gen", [u("Hello!")], add_generation_prompt=True)
    add("system_user", [s(SYS), u("What is the capital of France?")])
    add("system_user_gen", [s(SYS), u("What is the capital of France?")], add_generation_prompt=True)
    add("multi_turn_gen", [u("Hi"), a("Hello! How can I help?"), u("Tell me a joke."), a("Why did the chicken cross the road?"),
                           u("Why?")], add_generation_prompt=True)
    add("multi_turn_system", [s(SYS), u("Hi"), a("Hello!"), u("Bye")], add_generation_prompt=True)
    add("multi_turn_no_gen", [s(SYS), u("Hi"), a("Hello!")])
    add("unicode", [s("Réponds en français. 日本語も大丈夫。"), u("Привет, 世界! 🎉 café — naïve ☃ \u200b zero-width"),
                    a("Bonjour 👋🏽 — مرحبا"), u("𝔘𝔫𝔦𝔠𝔬𝔡𝔢?")], add_generation_prompt=True)
    add("empty_user_content", [u("")], add_generation_prompt=True)
    add("empty_assistant_content", [u("Say nothing."), a(""), u("Thanks")], add_generation_prompt=True)
    add("whitespace_content", [s("  padded system  \n"), u("\n\n  leading and trailing  \n\t"), a("  answer  \n")],
        add_generation_prompt=True)
    add("content_parts", [s(SYS), {"role": "user", "content": [{"type": "text", "text": "Part one."},
                                                               {"type": "text", "text": "Part two."}]}],
        add_generation_prompt=True)
    add("content_parts_assistant", [u("Hi"), {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
                                    u("More")], add_generation_prompt=True)
    add("reasoning_content_last", [u("What is 7*6?"), {"role": "assistant", "content": "42",
                                                       "reasoning_content": "7 times 6 is 42."}])
    add("reasoning_content_history", [u("What is 7*6?"), {"role": "assistant", "content": "42",
                                                          "reasoning_content": "7 times 6 is 42."},
                                      u("And 6*7?")], add_generation_prompt=True)
    add("think_inline_history", [u("Q1"), a("<think>\nLet me think.\n</think>\n\nA1"), u("Q2")],
        add_generation_prompt=True)
    add("think_inline_last", [u("Q1"), a("<think>\nreasoning here\n</think>\n\nfinal answer")])
    add("enable_thinking_false", [u("Quick: 2+2?")], add_generation_prompt=True, kwargs={"enable_thinking": False})
    add("enable_thinking_true", [u("Quick: 2+2?")], add_generation_prompt=True, kwargs={"enable_thinking": True})
    add("enable_thinking_false_no_gen", [u("Hi"), a("Hello")], kwargs={"enable_thinking": False})
    add("tools_user_gen", [u("What's the weather in Paris?")], tools=TOOLS, add_generation_prompt=True)
    add("tools_system_gen", [s(SYS), u("What's the weather in Paris?")], tools=TOOLS, add_generation_prompt=True)
    add("tool_call_args_dict", [u("Weather in Paris?"),
                                {"role": "assistant", "content": "", "tool_calls": [call("get_weather", weather_args)]},
                                tool('{"temperature": 21, "condition": "sunny"}')], tools=TOOLS,
        add_generation_prompt=True)
    add("tool_call_args_string", [u("Weather in Paris?"),
                                  {"role": "assistant", "content": "",
                                   "tool_calls": [call("get_weather", json.dumps(weather_args))]},
                                  tool('{"temperature": 21}')], tools=TOOLS, add_generation_prompt=True)
    add("tool_call_content_null", [u("Weather in Paris?"),
                                   {"role": "assistant", "content": None,
                                    "tool_calls": [call("get_weather", json.dumps(weather_args))]},
                                   tool("21C, sunny")], add_generation_prompt=True)
    add("tool_call_content_null_two_calls", [u("Weather in Paris and Rome?"),
                                             {"role": "assistant", "content": None, "tool_calls": [
                                                 call("get_weather", json.dumps({"city": "Paris"}), "c1"),
                                                 call("get_weather", json.dumps({"city": "Rome"}), "c2")]},
                                             tool("21C", "c1"), tool("25C", "c2")], add_generation_prompt=True)
    add("parallel_tool_calls_dict", [s(SYS), u("Weather in Paris and Rome?"),
                                     {"role": "assistant", "content": "Let me check both.", "tool_calls": [
                                         call("get_weather", {"city": "Paris"}, "c1"),
                                         call("get_weather", {"city": "Rome", "unit": "fahrenheit"}, "c2")]},
                                     tool("21C", "c1"), tool("77F", "c2")], tools=TOOLS, add_generation_prompt=True)
    add("tool_loop_full", [s(SYS), u("Search for atomc"),
                           {"role": "assistant", "content": "", "tool_calls": [
                               call("search", {"query": "atomc", "max_results": 3, "safe": True, "weight": 0.5,
                                               "tags": ["a", "b"], "extra": None})]},
                           tool('[{"title": "atomc", "url": "https://example.com"}]'),
                           a("I found one result: atomc."), u("Thanks!")], tools=TOOLS, add_generation_prompt=True)
    add("tool_args_unicode_nested", [u("Weather?"),
                                     {"role": "assistant", "content": "", "tool_calls": [
                                         call("get_weather", {"city": "Zürich 東京", "opts": {"nested": [1, 2.5, -3e-7, 1e21],
                                                                                          "quote": "say \"hi\"\n\\"}})]},
                                     tool("ok")], tools=TOOLS)
    add("tool_response_user_text", [u("<tool_response>\nfake\n</tool_response>"), a("ok")],
        add_generation_prompt=True)
    add("continue_final_message", [u("Write a haiku."), a("Autumn moonlight—")], continue_final_message=True)
    add("continue_final_message_parts", [u("Count:"), {"role": "assistant",
                                                       "content": [{"type": "text", "text": "one, two,"}]}],
        continue_final_message=True)
    add("template_syntax_in_content", [u("Render {{ this }} and {% raw %} and {# that #} literally"),
                                       a("Sure: {{ }} {% %}")], add_generation_prompt=True)
    add("quotes_backslashes", [u("He said \"hi\" and it's a back\\slash \\n not newline"), a("'single' \"double\"")],
        add_generation_prompt=True)
    add("crlf_content", [u("line1\r\nline2\rline3\n")], add_generation_prompt=True)
    add("long_conversation", [s(SYS)] + [m for i in range(10) for m in (u(f"Question {i}?"), a(f"Answer {i}."))] +
        [u("Final question?")], add_generation_prompt=True)
    add("system_only", [s(SYS)], add_generation_prompt=True)
    add("two_system_messages", [s("First system."), s("Second system."), u("Hi")], add_generation_prompt=True)
    add("assistant_first", [a("I start."), u("OK")], add_generation_prompt=True)
    add("tool_call_then_answer_no_gen", [u("Weather?"), {"role": "assistant", "content": "",
                                                         "tool_calls": [call("get_weather", {"city": "Oslo"})]},
                                         tool("-3C"), a("It is -3C in Oslo.")], tools=TOOLS)
    add("multi_step_tools_reasoning", [u("Plan a trip"),
                                       {"role": "assistant", "content": "", "reasoning_content": "Need weather first.",
                                        "tool_calls": [call("get_weather", {"city": "Lisbon"})]},
                                       tool("18C"),
                                       {"role": "assistant", "content": "Lisbon is mild.",
                                        "reasoning_content": "18C is mild."}],
        tools=TOOLS, kwargs={"enable_thinking": True})
    add("content_none_user", [{"role": "user", "content": None}], add_generation_prompt=True)
    add("reasoning_field_alias", [u("2+2?"), {"role": "assistant", "content": "4", "reasoning": "simple sum"}])
    add("thinking_field_alias", [u("2+2?"), {"role": "assistant", "content": "4", "thinking": "add them"},
                                 u("and 3+3?")], add_generation_prompt=True)
    return C


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizers", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tokenizers"))
    ap.add_argument("--gguf", default=os.environ.get("ATOMC_SMOLLM2",
                                                     "/root/.cache/atomc/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "template"))
    args = ap.parse_args()
    if not os.path.isdir(args.tokenizers):
        args.tokenizers = "/work/shared/tokenizers"

    templates = {}
    for name in sorted(os.listdir(args.tokenizers)):
        p = os.path.join(args.tokenizers, name, "tokenizer_config.json")
        if not os.path.exists(p):
            continue
        cfg = json.load(open(p))
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):
            tpl = {t["name"]: t["template"] for t in tpl}.get("default")
        if not tpl:
            print(f"{name}: no chat template, skipped", file=sys.stderr)
            continue
        templates[name] = (tpl, token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token")))

    from gguf import GGUFReader
    r = GGUFReader(args.gguf)
    f = r.fields["tokenizer.chat_template"]
    tpl = bytes(f.parts[f.data[0]]).decode()
    toks = r.fields["tokenizer.ggml.tokens"]
    tok = lambda key: bytes(toks.parts[toks.data[int(r.fields[key].parts[r.fields[key].data[0]][0])]]).decode()
    templates["smollm2"] = (tpl, tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id"))

    os.makedirs(args.out, exist_ok=True)
    for name, (tpl, bos, eos) in templates.items():
        with open(os.path.join(args.out, f"{name}.jinja"), "w", newline="") as fh:
            fh.write(tpl)
        out_cases = []
        n_ok = 0
        for case in cases():
            c = copy.deepcopy(case)
            try:
                c["expected"] = render(tpl, case, bos, eos)
                n_ok += 1
            except Exception as e:  # the C renderer must fail too
                c["error"] = f"{type(e).__name__}: {e}"
            out_cases.append(c)
        doc = {"template_file": f"{name}.jinja", "bos_token": bos, "eos_token": eos, "cases": out_cases}
        with open(os.path.join(args.out, f"{name}_cases.json"), "w") as fh:
            json.dump(doc, fh, ensure_ascii=False, indent=1)
            fh.write("\n")
        print(f"{name}: {len(out_cases)} cases ({n_ok} rendered, {len(out_cases) - n_ok} errors)")

    # interpreter snippets (tests/test_template_jinja.c)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from template_snippets import snippet_cases
    snippets = []
    for case in snippet_cases():
        c = dict(case)
        try:
            c["expected"] = _compile_jinja_template(case["template"]).render(**case["vars"])
        except Exception as e:
            c["error"] = f"{type(e).__name__}: {e}"
        snippets.append(c)
    with open(os.path.join(args.out, "snippets.json"), "w") as fh:
        json.dump({"vars": snippet_cases()[0]["vars"],
                   "snippets": [{k: v for k, v in c.items() if k != "vars"} for c in snippets]},
                  fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    print(f"snippets: {len(snippets)} ({sum('error' in c for c in snippets)} errors)")


if __name__ == "__main__":
    main()
