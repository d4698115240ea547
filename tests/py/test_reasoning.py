"""--reasoning-parser with SmolLM2-135M-Instruct ($ATOMC_SMOLLM2) through the openai client.

SmolLM2 does not think, so the server gets a Qwen3-style chat template (ChatML that opens
"<think>\\n" in the generation prompt unless chat_template_kwargs {"enable_thinking": false}, and
writes an empty think block then, as Qwen3's does). With the qwen3 parser the generated text must
land in reasoning_content exactly when the template opened the think block; the reference for
that text is the server's plain /v1/completions on the prompt /apply-template renders with the
same kwargs (so this also shows chat_template_kwargs reach the template). Streamed
delta.reasoning_content must add up to the non-streamed message. deepseek_r1 treats an output
without </think> as all reasoning; a bad --reasoning-parser name is refused at start-up.
Parsing itself (every split of real outputs, harmony included) is in tests/test_reasoning_parser.c
and tests/test_parser_http.c."""
import json
import subprocess

import pytest

from server_util import ATOMC_BIN, SMOLLM2, Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.skipif(not SMOLLM2, reason="set ATOMC_SMOLLM2 to the SmolLM2-135M-Instruct GGUF")

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
MSGS = [{"role": "user", "content": "Why is the sky blue?"}]
N = 24


def serve(tmp_path_factory, parser):
    path = tmp_path_factory.mktemp("tmpl") / "think.jinja"
    path.write_text(TEMPLATE)
    return Server(SMOLLM2, "--max-model-len", "1024", "--max-num-seqs", "4", "--served-model-name", "smol",
                  "--chat-template", str(path), "--reasoning-parser", parser)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    s = serve(tmp_path_factory, "qwen3")
    yield s
    assert s.stop() == 0, s.read_log()


def client_of(s):
    return openai.OpenAI(base_url=f"{s.base}/v1", api_key="none", max_retries=0, timeout=120)


def reference(s, kwargs):
    """The plain greedy completion of the prompt the template renders with these kwargs."""
    st, t = s.json("POST", "/apply-template", {"messages": MSGS, "chat_template_kwargs": kwargs})
    assert st == 200, t
    r = client_of(s).completions.create(model="smol", prompt=t["prompt"], max_tokens=N, temperature=0)
    return t["prompt"], r.choices[0].text


def chat(s, kwargs, stream=False):
    c = client_of(s)
    kw = dict(model="smol", messages=MSGS, max_tokens=N, temperature=0, extra_body={"chat_template_kwargs": kwargs})
    if not stream:
        m = c.chat.completions.create(**kw).choices[0].message
        return (m.model_extra or {}).get("reasoning_content"), m.content
    reasoning, content = "", ""
    for ch in c.chat.completions.create(stream=True, **kw):
        if ch.choices:
            d = ch.choices[0].delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
    return reasoning or None, content or None


def test_thinking_on_output_is_reasoning(qwen3):
    prompt, ref = reference(qwen3, {})
    assert prompt.endswith("<think>\n") and ref and "</think>" not in ref
    reasoning, content = chat(qwen3, {})
    assert reasoning == ref  # the template opened <think>: no </think> came, all of it is reasoning
    assert content is None
    assert chat(qwen3, {}, stream=True) == (ref, None)


def test_enable_thinking_false_output_is_content(qwen3):
    prompt, ref = reference(qwen3, {"enable_thinking": False})
    assert prompt.endswith("<think>\n\n</think>\n\n")
    reasoning, content = chat(qwen3, {"enable_thinking": False})
    assert reasoning is None and content == ref
    assert chat(qwen3, {"enable_thinking": False}, stream=True) == (None, ref)


def test_deepseek_r1_output_without_end_tag_is_reasoning(tmp_path_factory):
    s = serve(tmp_path_factory, "deepseek_r1")
    try:
        _, ref = reference(s, {"enable_thinking": False})
        assert ref
        assert chat(s, {"enable_thinking": False}) == (ref, None)
        assert chat(s, {"enable_thinking": False}, stream=True) == (ref, None)
    finally:
        assert s.stop() == 0, s.read_log()


def test_unknown_reasoning_parser_is_refused():
    p = subprocess.run([ATOMC_BIN, "serve", "--model", SMOLLM2, "--reasoning-parser", "deepseek-r1"],
                       capture_output=True, timeout=60)
    assert p.returncode == 2
    err = p.stderr.decode()
    assert "unknown --reasoning-parser 'deepseek-r1'" in err and "deepseek_r1, qwen3, glm45, openai_gptoss" in err
    p = subprocess.run([ATOMC_BIN, "serve", "--model", SMOLLM2, "--enable-auto-tool-choice", "--tool-call-parser",
                        "qwen"], capture_output=True, timeout=60)
    assert p.returncode == 2 and "qwen3_coder" in p.stderr.decode()


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"],
          "additionalProperties": False}


def test_structured_output_applies_after_the_reasoning(qwen3):
    # Reasoning closed by the prompt (enable_thinking false): the grammar constrains the whole output.
    c = client_of(qwen3)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    r = c.chat.completions.create(model="smol", messages=MSGS, max_tokens=40, temperature=0, response_format=fmt,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    assert (m.model_extra or {}).get("reasoning_content") is None
    assert set(json.loads(m.content)) == {"answer"}
    # Reasoning open: the grammar must wait for "</think>", which SmolLM2 spells in 3 tokens: a 400 naming it.
    st, body = qwen3.json("POST", "/v1/chat/completions", {"model": "smol", "messages": MSGS, "max_tokens": 8,
                                                           "response_format": fmt})
    assert st == 400 and "</think>" in body["error"]["message"] and "(it is 3)" in body["error"]["message"]
