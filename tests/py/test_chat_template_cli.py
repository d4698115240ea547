"""`atomc chat-template` end to end: the CLI must print exactly the jinja2 reference
renderings committed in tests/fixtures/template/*_cases.json (made by
tools/gen_template_refs.py), and fail (exit 1, message on stderr) where jinja2 failed."""
import json
import os
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FIX = os.path.join(ROOT, "tests", "fixtures", "template")
ATOMC = os.environ.get("ATOMC_BIN", os.path.join(ROOT, "build", "atomc"))
MODELS = ["llama3", "qwen3", "deepseek_v3", "smollm2"]


def load(model):
    with open(os.path.join(FIX, f"{model}_cases.json")) as f:
        return json.load(f)


def run_case(tmp_path, doc, case):
    msgs = tmp_path / "messages.json"
    msgs.write_text(json.dumps(case["messages"], ensure_ascii=False), encoding="utf-8")
    cmd = [ATOMC, "chat-template", "--chat-template", os.path.join(FIX, doc["template_file"]),
           "--messages", str(msgs)]
    if doc.get("bos_token") is not None:
        cmd += ["--bos", doc["bos_token"]]
    if doc.get("eos_token") is not None:
        cmd += ["--eos", doc["eos_token"]]
    if case.get("tools"):
        tools = tmp_path / "tools.json"
        tools.write_text(json.dumps(case["tools"]), encoding="utf-8")
        cmd += ["--tools", str(tools)]
    if case.get("add_generation_prompt"):
        cmd.append("--add-generation-prompt")
    if case.get("continue_final_message"):
        cmd.append("--continue-final-message")
    if case.get("kwargs"):
        cmd += ["--kwargs", json.dumps(case["kwargs"])]
    return subprocess.run(cmd, capture_output=True)


@pytest.mark.parametrize("model", MODELS)
def test_cli_matches_jinja2(model, tmp_path):
    doc = load(model)
    assert len(doc["cases"]) >= 30
    for case in doc["cases"]:
        p = run_case(tmp_path, doc, case)
        if "expected" in case:
            assert p.returncode == 0, f"{case['name']}: {p.stderr.decode()}"
            assert p.stdout.decode("utf-8") == case["expected"], case["name"]
        else:
            assert p.returncode == 1, case["name"]
            assert p.stderr.decode().startswith("atomc chat-template: "), case["name"]


def test_cli_reads_model_dir_and_rejects_bad_input(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<B>"}, "eos_token": "<E>",
        "model_max_length": 1000000000000000019884624838656,
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"},
                          {"name": "tool_use", "template": "TOOLS{{ tools | length }}"}]}))
    msgs = tmp_path / "m.json"
    msgs.write_text('[{"role": "user", "content": "hi"}]')
    tools = tmp_path / "t.json"
    tools.write_text('[{"type": "function", "function": {"name": "f"}}]')
    p = subprocess.run([ATOMC, "chat-template", "--model", str(tmp_path), "--messages", str(msgs)], capture_output=True)
    assert p.returncode == 0 and p.stdout == b"<B>hi<E>", p.stderr
    p = subprocess.run([ATOMC, "chat-template", "--model", str(tmp_path), "--messages", str(msgs), "--tools", str(tools)],
                       capture_output=True)
    assert p.returncode == 0 and p.stdout == b"TOOLS1", p.stderr
    msgs.write_text('[{"role": 1}]')
    p = subprocess.run([ATOMC, "chat-template", "--model", str(tmp_path), "--messages", str(msgs)], capture_output=True)
    assert p.returncode == 1 and b"messages[0].role must be a string" in p.stderr
    # transformers >= 4.43 keeps the template in chat_template.jinja, which wins
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}{{ bos_token }}\n")
    msgs.write_text('[{"role": "user", "content": "hi"}]')
    p = subprocess.run([ATOMC, "chat-template", "--model", str(tmp_path), "--messages", str(msgs)], capture_output=True)
    assert p.returncode == 0 and p.stdout == b"J1<B>", p.stderr  # one trailing newline dropped, as jinja2 does
    msgs.write_text('[{"role": 1}]')
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for x in y %}\n{{ x }")
    p = subprocess.run([ATOMC, "chat-template", "--chat-template", str(bad), "--messages", str(msgs)], capture_output=True)
    assert p.returncode == 1 and b"line 2" in p.stderr


@pytest.mark.skipif(not os.path.exists(os.environ.get("ATOMC_SMOLLM2", "/root/.cache/atomc/models/SmolLM2-135M-Instruct.Q4_1.gguf")),
                    reason="SmolLM2 GGUF not available")
def test_cli_reads_gguf_template(tmp_path):
    gguf = os.environ.get("ATOMC_SMOLLM2", "/root/.cache/atomc/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    doc = load("smollm2")
    case = next(c for c in doc["cases"] if c["name"] == "multi_turn_system")
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps(case["messages"]))
    p = subprocess.run([ATOMC, "chat-template", "--model", gguf, "--messages", str(msgs), "--add-generation-prompt"],
                       capture_output=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode() == case["expected"]
    # a model directory holding just the .gguf works too
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.gguf").symlink_to(os.path.abspath(gguf))
    p = subprocess.run([ATOMC, "chat-template", "--model", str(d), "--messages", str(msgs), "--add-generation-prompt"],
                       capture_output=True)
    assert p.returncode == 0 and p.stdout.decode() == case["expected"], p.stderr
