"""Structured output end to end (issue 23): `atomc serve` with SmolLM2-135M-Instruct ($ATOMC_SMOLLM2)
through the official openai client. Outputs are sampled at temperature 1.0 and must still be valid:
50 json_schema requests of varied schemas (nested objects, arrays, enums, required fields, integer
ranges, string lengths, patterns and the format uuid) validate with Python `jsonschema`; regex, choice and
EBNF outputs match; tool_choice "required" / a named function always yield a valid call; invalid
schemas, regexes and grammars get 400s naming the problem while the server keeps serving.
Every schema bounds its output (maxLength, maxItems, integer ranges, enums), so each answer ends
within max_tokens with finish_reason "stop"."""
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_util import SMOLLM2, Server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.skipif(not SMOLLM2, reason="set ATOMC_SMOLLM2 to the SmolLM2-135M-Instruct GGUF")

MAX_TOKENS = 320


@pytest.fixture(scope="module")
def srv():
    s = Server(SMOLLM2, "--max-model-len", "1024", "--max-num-seqs", "16", "--served-model-name", "smol",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    assert s.stop() == 0, s.read_log()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.base}/v1", api_key="none", max_retries=0, timeout=300)


# ---- 50 varied schemas, each with a bounded output ----

WORDS = ["name", "city", "title", "color", "kind", "label", "owner", "code", "tag", "note", "status", "level"]


def leaf(rng, depth):
    k = rng.randrange(9 if depth < 2 else 7)
    if k == 0:
        return {"type": "string", "maxLength": rng.choice([4, 8, 12])}
    if k == 1:
        return {"type": "string", "minLength": 1, "maxLength": rng.choice([3, 6])}
    if k == 2:
        lo = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([9, 99, 999])}
    if k == 3:
        return {"type": "boolean"}
    if k == 4:
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", 1, 2, True, None], rng.randrange(2, 5))}
    if k == 5:
        # Not "date" / "ipv4": xgrammar's patterns admit 02-31 and leading zeros ("68.02.1.1"), which
        # Python's checkers (date.fromisoformat, ipaddress) refuse.
        return rng.choice([{"type": "string", "pattern": "^[a-z]{1,5}\\.[a-z]{2,3}$"},
                           {"type": "string", "format": "uuid"}, {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}])
    if k == 6:
        return {"type": "array", "items": leaf(rng, 2), "maxItems": rng.choice([1, 2, 3]),
                "minItems": rng.choice([0, 1])}
    if k == 7:
        return obj(rng, depth + 1)
    return {"type": "array", "items": obj(rng, depth + 1), "maxItems": 2}


def obj(rng, depth):
    keys = rng.sample(WORDS, rng.randrange(1, 4 if depth else 5))
    props = {k: leaf(rng, depth) for k in keys}
    req = [k for k in keys if rng.random() < 0.7] or keys[:1]
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


def schemas():
    rng = random.Random(23)
    out = [obj(rng, 0) for _ in range(44)]
    # A few fixed shapes besides the random ones.
    out += [
        {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
        {"type": "object", "properties": {"person": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["first", "age"]}}, "required": ["person"]},
        {"type": "string", "enum": ["alpha", "beta", "gamma"]},
        {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                          "code": {"type": "string", "pattern": "^[0-9]{3}$"}}, "required": ["id", "code"]},
        {"anyOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                   {"type": "object", "properties": {"b": {"type": "integer", "minimum": 1, "maximum": 5}},
                    "required": ["b"]}]},
    ]
    assert len(out) == 50
    return out


def validate(schema, text):
    doc = json.loads(text)
    jsonschema.validate(doc, schema, format_checker=jsonschema.FormatChecker())
    return doc


def test_fifty_json_schemas_at_temperature_one_validate(client):
    def one(i_schema):
        i, schema = i_schema
        r = client.chat.completions.create(
            model="smol", temperature=1.0, max_tokens=MAX_TOKENS, seed=1000 + i,
            messages=[{"role": "user", "content": "Describe something as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return schema, r.choices[0]

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, enumerate(schemas())))
    for schema, ch in results:
        assert ch.finish_reason == "stop", (schema, ch.message.content)
        validate(schema, ch.message.content)


def test_json_object_and_streaming_schema(client):
    r = client.chat.completions.create(model="smol", temperature=1.0, max_tokens=MAX_TOKENS, seed=5,
                                       messages=[{"role": "user", "content": "Give me a JSON object."}],
                                       response_format={"type": "json_object"})
    ch = r.choices[0]
    if ch.finish_reason == "stop":  # any object: it may be longer than max_tokens
        assert isinstance(json.loads(ch.message.content), dict)
    else:
        assert ch.message.content.lstrip().startswith("{")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "w": {"type": "string", "maxLength": 8}}, "required": ["n", "w"]}
    text = ""
    finish = None
    for chunk in client.chat.completions.create(
            model="smol", temperature=1.0, max_tokens=MAX_TOKENS, seed=6, stream=True,
            messages=[{"role": "user", "content": "JSON please"}],
            extra_body={"structured_outputs": {"json": schema}}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    validate(schema, text)


def test_regex_choice_and_grammar_outputs_match(client):
    pats = [r"[A-Z][a-z]{2,6} [0-9]{1,3}", r"(yes|no|maybe)!", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"#[0-9a-f]{6}"]
    for i, p in enumerate(pats):
        for field in ("structured_outputs", "guided_regex"):
            body = {"structured_outputs": {"regex": p}} if field == "structured_outputs" else {"guided_regex": p}
            r = client.completions.create(model="smol", prompt="Answer:", temperature=1.0, max_tokens=40,
                                          seed=i, extra_body=body)
            assert r.choices[0].finish_reason == "stop"
            assert re.fullmatch(p, r.choices[0].text), (p, r.choices[0].text)
    choices = ["Paris", "London", "Rome", "New York"]
    seen = set()
    for i in range(8):
        r = client.chat.completions.create(model="smol", temperature=1.0, max_tokens=20, seed=i,
                                           messages=[{"role": "user", "content": "Pick a city."}],
                                           extra_body={"guided_choice": choices})
        assert r.choices[0].message.content in choices
        seen.add(r.choices[0].message.content)
    r = client.completions.create(model="smol", prompt="Q:", temperature=1.0, max_tokens=20, n=4,
                                  extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert all(c.text in ("up", "down") for c in r.choices)
    g = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    r = client.completions.create(model="smol", prompt="Sum:", temperature=1.0, max_tokens=60, seed=3,
                                  extra_body={"guided_grammar": g})
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", r.choices[0].text), r.choices[0].text
    else:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*(\+[1-9]?)?", r.choices[0].text), r.choices[0].text


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 16},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a time zone",
                                      "parameters": {"type": "object", "properties": {
                                          "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                                          "required": ["zone"]}}},
]


def test_tool_choice_required_always_yields_a_valid_call(client):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for i in range(6):
        r = client.chat.completions.create(model="smol", temperature=1.0, max_tokens=120, seed=i, tools=TOOLS,
                                           tool_choice="required",
                                           messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0].function
        assert call.name in params
        jsonschema.validate(json.loads(call.arguments), params[call.name])
    r = client.chat.completions.create(model="smol", temperature=1.0, max_tokens=120, seed=9, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       messages=[{"role": "user", "content": "Weather in Oslo?"}])
    call = r.choices[0].message.tool_calls[0].function
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), params["get_time"])


def test_invalid_constraints_get_400_and_the_server_keeps_serving(srv, client):
    def bad(body, needle, endpoint="/v1/completions"):
        base = {"model": "smol", "max_tokens": 5}
        base.update({"prompt": "x"} if endpoint == "/v1/completions" else
                    {"messages": [{"role": "user", "content": "x"}]})
        base.update(body)
        st, j = srv.json("POST", endpoint, base)
        assert st == 400, (body, st, j)
        assert needle in j["error"]["message"], (body, j)

    bad({"guided_json": {"type": "no-such-type"}}, "json schema")
    bad({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
        "json schema", "/v1/chat/completions")
    bad({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema", "/v1/chat/completions")
    bad({"structured_outputs": {"regex": "([a-z]"}}, "regex")
    bad({"guided_grammar": "root ::= "}, "grammar")
    bad({"guided_grammar": "start: ("}, "grammar")
    bad({"guided_choice": []}, "non-empty")
    bad({"guided_regex": "a", "guided_choice": ["b"]}, "only one kind")
    bad({"structured_outputs": {"regex": "a" * 70000}}, "limit")
    bad({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope",
        "/v1/chat/completions")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt="x", max_tokens=5, extra_body={"guided_regex": "(("})
    r = client.completions.create(model="smol", prompt="Hello", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
