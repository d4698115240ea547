"""Tokenizers in tiktoken form (tiktoken.model + tokenizer_config.json, as Kimi-K2 and Moonlight ship).

Llama-3's tokenizer.json (../shared) is converted to tiktoken form by tools/convert_to_tiktoken.py;
atomc's ids for the 289 conformance strings (tests/fixtures/tokenizer/corpus.json) must equal
  - HF tokenizers on the original tokenizer.json, and
  - OpenAI's tiktoken built from the same ranks and pattern,
with the pattern given as pat_str, and with Kimi's own pattern (auto_map naming tokenization_kimi,
no pat_str; the reference is tiktoken running Kimi's upstream pattern, class intersections and all)
over the corpus plus mixed Han / kana / Latin text where that pattern differs from Llama-3's."""
import base64
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
ROOT = os.path.join(HERE, "..", "..")
ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
LLAMA3 = os.path.join(ROOT, "..", "shared", "tokenizers", "llama3")
sys.path.insert(0, os.path.join(ROOT, "tools"))

tiktoken = pytest.importorskip("tiktoken")
tokenizers = pytest.importorskip("tokenizers")
if not os.path.exists(os.path.join(LLAMA3, "tokenizer.json")):
    pytest.skip("../shared/tokenizers/llama3 is missing", allow_module_level=True)

from convert_to_tiktoken import convert  # noqa: E402

KIMI_UPSTREAM = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
MIXED = ["Hello世界abc", "日本語のテキストとEnglish words", "ÀÉÎ中文ÕÜ", "東京Tokyo大阪Osaka", "中文English中文",
         "数字123和456", "ДобрыйДень中国", "한국어와中文", "Mixed CASE中Ab", " 空格 中 文 ", "a中b中c"]


def corpus():
    # Invalid UTF-8 entries ({"b64": ...}) as the string a caller would hand over: U+FFFD-replaced.
    items = json.load(open(os.path.join(ROOT, "tests", "fixtures", "tokenizer", "corpus.json")))
    return [c["text"] if "text" in c else base64.b64decode(c["b64"]).decode("utf-8", errors="replace") for c in items]


def atomc_ids(model_dir, texts):
    inp = "".join(json.dumps(t) + "\n" for t in texts)
    out = subprocess.run([ATOMC, "tokenize", "--model", model_dir, "--jsonl"], input=inp, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(l) for l in out.stdout.splitlines()]
    assert len(lines) == len(texts)
    return lines


def reference(ranks, specials, pattern):
    return tiktoken.Encoding("ref", pat_str=pattern, mergeable_ranks={b: i for i, b in enumerate(ranks)},
                             special_tokens=specials)


def test_llama3_in_tiktoken_form_matches_tokenizers_and_tiktoken(tmp_path):
    out = tmp_path / "llama3_tt"
    ranks, specials = convert(LLAMA3, str(out), "split")
    texts = corpus()
    got = atomc_ids(str(out), texts)
    hf = tokenizers.Tokenizer.from_file(os.path.join(LLAMA3, "tokenizer.json"))
    pat = json.load(open(out / "tokenizer_config.json"))["pat_str"]
    tt = reference(ranks, specials, pat)
    bad = [(t, g) for t, g in zip(texts, got) if g != hf.encode(t, add_special_tokens=True).ids]
    assert not bad, bad[:3]
    assert got == [tt.encode(t, allowed_special="all") for t in texts]
    # Special tokens in the text are matched as specials, as tiktoken (allowed_special="all") does.
    s = "<|begin_of_text|>Hi<|eot_id|>"
    assert atomc_ids(str(out), [s])[0] == tt.encode(s, allowed_special="all") == [128000, 13347, 128009]


def test_kimi_pattern_without_pat_str(tmp_path):
    out = tmp_path / "kimi_tt"
    ranks, specials = convert(LLAMA3, str(out), "kimi")
    texts = corpus() + MIXED
    got = atomc_ids(str(out), texts)
    tt = reference(ranks, specials, KIMI_UPSTREAM)
    want = [tt.encode(t, allowed_special="all") for t in texts]
    bad = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not bad, bad[:3]
    # The Kimi pattern splits Han runs from Latin letters; Llama-3's would not (the test can fail).
    llama_pat = reference(ranks, specials, json.load(open(os.path.join(LLAMA3, "tokenizer.json")))
                          ["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"])
    assert any(llama_pat.encode(t) != w for t, w in zip(MIXED, want[-len(MIXED):]))
    # Kimi reserves 256 ids after the ranks; those its config leaves unnamed are <|reserved_token_ID|>.
    n = len(ranks)
    cfg = json.load(open(out / "tokenizer_config.json"))
    del cfg["added_tokens_decoder"][str(n + 255)]
    json.dump(cfg, open(out / "tokenizer_config.json", "w"))
    s = f"x<|reserved_token_{n + 255}|>y<|reserved_special_token_0|>"
    assert atomc_ids(str(out), [s])[0] == [87, n + 255, 88, n + 2]


def test_bad_tiktoken_files_are_refused(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "tiktoken.model").write_text("IQ== 0\n")
    (d / "tokenizer_config.json").write_text("{}")
    r = subprocess.run([ATOMC, "tokenize", "--model", str(d), "--text", "x"], capture_output=True, text=True)
    assert r.returncode != 0 and "pre-tokenizer pattern" in r.stderr
    (d / "tokenizer_config.json").write_text('{"pat_str": "\\\\S+"}')
    for body, msg in [("IQ== 0\n", "single-byte token"), ("IQ== 1\n", "ranks are not 0..N-1"),
                      ("!!!! 0\n", "bad base64 at line 1"), ("IQ==\n", "not \"<base64> <rank>\""),
                      ("IQ== 0\nIQ== 1\n", "appears twice")]:
        (d / "tiktoken.model").write_text(body)
        r = subprocess.run([ATOMC, "tokenize", "--model", str(d), "--text", "x"], capture_output=True, text=True)
        assert r.returncode != 0 and msg in r.stderr, (body, r.stderr)
