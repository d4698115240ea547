#!/usr/bin/env python3
"""Writes the tokenizer conformance fixtures under tests/fixtures/tokenizer/.

  corpus.json      the hard strings (>= 200): {"text": str} or {"b64": raw bytes} for invalid UTF-8
  ref_<name>.json  per tokenizer, from HF `tokenizers` (PyPI):
                     ids[i]            encode(text_i, add_special_tokens=False).ids
                     special_prefix /
                     special_suffix    what add_special_tokens=True adds around ids (checked equal
                                       for every string)
                     decode[i]         decode(ids[i], skip_special_tokens=False), null when == text_i
                     decode_skip[i]    decode(ids[i], skip_special_tokens=True), null when == decode[i]

Invalid UTF-8 input: HF's Python API only takes str, so the reference for bytes b is
encode(b.decode("utf-8", errors="replace")); atomc replaces invalid bytes the same way.

add_special_tokens: for Llama/Gemma tokenizer classes whose tokenizer_config.json sets
add_bos_token / add_eos_token, transformers' fast tokenizers rebuild the post-processor as
[bos] A [eos]; we do the same here (with tokenizers.processors.TemplateProcessing) and atomc
follows it. Other tokenizers keep tokenizer.json's post-processor.

SmolLM2: its tokenizer comes from the GGUF (tokenizer.ggml.*); the reference tokenizer is the one
transformers builds from it (AutoTokenizer.from_pretrained(dir, gguf_file=...)).

Usage: python3 tools/gen_tokenizer_refs.py [--shared ../shared] [--smollm2 PATH.gguf]
"""
import argparse
import base64
import json
import os
import random
import sys

import tokenizers
from tokenizers import processors

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
NAMES = ["llama2", "llama3", "qwen3", "deepseek_v3", "gpt_oss"]


def english_text(rng, n_bytes):
    words = ("the of and to in is that for it as was with be by on not he I this are or his from at which "
             "but have an they you were her she there would their we him been has when who will more no if "
             "out so said what up its about into than them can only other new some could time these two may "
             "then do first any my now such like our over man me even most made after also did many before "
             "must through back years where much your way well down should because each just those people "
             "Mr how too little state good very make world still own see men work long get here between both "
             "life being under never day same another know while last might us great old year off come since "
             "against go came right used take three tokenizer's don't isn't we'll they're I've 2024 3.14 "
             "co-operate e-mail naïve café résumé Zürich").split()
    out, size = [], 0
    while size < n_bytes:
        sent = " ".join(rng.choice(words) for _ in range(rng.randint(5, 18)))
        sent = sent[0].upper() + sent[1:] + rng.choice([".", ".", ".", "?", "!", ";", ":"])
        if rng.random() < 0.15:
            sent += "\n\n" if rng.random() < 0.5 else "\n"
        else:
            sent += " "
        out.append(sent)
        size += len(sent.encode())
    return "".join(out)


CODE = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    a, b = 0, 1
    out = []
    for _ in range(n):
        out.append(a)
        a, b = b, a + b
    return out


if __name__ == "__main__":
    print(fibonacci(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
'''

C_CODE = '''#include <stdio.h>
static int add(int a, int b) { return a + b; }
int main(void) {
\tfor (int i = 0; i < 10; ++i) {
\t\tprintf("%d\\n", add(i, i * 2));
\t}
\treturn 0;
}
'''


def corpus_items():
    s = []
    # Whitespace.
    s += ["", " ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\n\n", "\n\n\n", " \n", "\n ", "\t\t\t", " \t \t ",
          "a  b", "a   b", "a\tb", "a\nb", "a\r\nb", "line1\r\nline2\r\n", "trailing   ", "   leading",
          "  both  ", " " * 40, "x" + " " * 17 + "y", "\n" * 9 + "z", "a \n b \n\n c", "end with newline\n",
          "\u00a0nbsp\u00a0", "ideographic\u3000space", "zero\u200bwidth", "line\u2028sep", "\ufeffbom"]
    # Digits and numbers.
    s += ["1", "12", "123", "1234", "12345", "123456789", "12345678901234567890123", "3.14159", "-42",
          "1,000,000", "2024-01-01T12:34:56Z", "0x1F2E", "1e-10", "v1.2.3", "$100.00", "50%", "a1b2c3",
          "\u0661\u0662\u0663", "\u2460\u2461\u2462", "\u216b", "x\u00b2 + y\u00b3", "\uff11\uff12\uff13",
          "phone: +1 (555) 123-4567", "1 2 3 4 5", "007"]
    # Contractions and case.
    s += ["I'm", "don't", "you're", "we've", "she'll", "he'd", "it's", "IT'S", "DON'T", "O'Neil's",
          "'s", "'tis", "rock 'n' roll", "HELLO World", "camelCaseIdentifier", "snake_case_name",
          "SCREAMING_SNAKE", "McDonald's", "The Quick Brown Fox", "iPhone", "ALLCAPS WORDS HERE"]
    # Scripts.
    s += ["你好世界", "日本語のテキスト、カタカナとひらがな。", "한국어 텍스트입니다", "Hello你好world",
          "中文，标点符号！", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก",
          "Привет, мир!", "Γειά σου Κόσμε", "ქართული", "Tiếng Việt có dấu", "Ελληνικά και English",
          "ḱṷṓn", "ǅemal", "ß ẞ", "İstanbul ıi", "ᚠᛇᚻ᛫ᛒᛦᚦ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𐍈𐌰𐌹𐌽𐍃"]
    # Emoji.
    s += ["👍", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇺🇸🇯🇵", "🧑🏿‍💻", "I ❤️ NY", "😀😃😄😁",
          "emoji👍in👍text", "🤷‍♂️ shrug", "1️⃣2️⃣", "☕️ coffee"]
    # Combining marks, NFC/NFD.
    s += ["e\u0301", "\u00e9", "caf\u00e9 vs cafe\u0301", "A\u030a", "\u00c5", "n\u0303", "a\u0300\u0301\u0302",
          "\u1100\u1161\u11a8", "\uac01", "\ufb01nance", "Ｆｕｌｌｗｉｄｔｈ", "\u0041\u030a\u0301",
          "o\u0308\u0304", "\u212b", "\u2126", "x\u0338"]
    # Special-token text embedded in ordinary text.
    s += ["<s>", "</s>", "<unk>", "<s>hello</s>", "x<s>y", "<s><s>", " <s> ", "<|im_start|>",
          "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>", "<|endoftext|>",
          "<|begin_of_text|>Hello", "<|eot_id|>", "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
          "<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>", "<|start|>assistant<|channel|>final<|message|>ok<|return|>",
          "<|im_start", "im_start|>", "<|<|im_start|>|>", "<0x41>", "<0xE4><0xB8>", "\u2581word", "\u2581\u2581",
          "<think>\nreasoning\n</think>", "text <|im_start|> text", "<|endoftext|><|endoftext|>"]
    # Code, markup, URLs.
    s += [CODE, C_CODE, '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
          "<html><body><p class=\"x\">Hello &amp; bye</p></body></html>", "$ ls -la | grep '^d' > out.txt 2>&1",
          "SELECT * FROM users WHERE id = 42;", r"^\s*([A-Za-z_]\w*)\s*=\s*(.+?)\s*$",
          "https://example.com/path?query=1&b=two#frag", "mailto:someone@example.org",
          "C:\\Users\\name\\file.txt", "    indented code\n        more", "// comment\n/* block */",
          "x = a->b; y = *p++; z = i >= 0 && j <= 1 || !k;", "fn main() { println!(\"{}\", 1); }",
          "`inline code` and ```fenced```", "| a | b |\n|---|---|\n| 1 | 2 |", "- item\n- item 2\n  - nested",
          "#!/usr/bin/env bash\nset -euo pipefail\n"]
    # Punctuation.
    s += ["!!!???", "...", "\u2014\u2013-", "\u00ab\u00bb", "\u201cquoted\u201d", "\u2018single\u2019",
          "a.b.c", "(parens) [brackets] {braces}", "@#$%^&*", "~`|\\", ":-)", "hello,world", "end.", "?!",
          "...and then", "\u3002\u3001\uff01"]
    # Control characters.
    s += ["\x00", "a\x00b", "\x01\x02\x03", "\x7f", "\x1b[31mred\x1b[0m", "\x0b\x0c"]
    out = [{"text": x} for x in s]
    # Invalid UTF-8.
    for b in [b"\xff", b"\xfe\xff", b"abc\xe4\xb8", b"\xe4\xb8abc", b"\xc0\x80", b"\xed\xa0\x80",
              b"\xf0\x9f\x98", b"\xf0\x9f\x98 x", b"\x80\x80hello", b"\xf8\x88\x80\x80\x80", b"ok\xc3(",
              b"\xe0\x80\xaf", b"\xf4\x90\x80\x80", b"mixed \xe2\x82 euro \xe2\x82\xac", b"\xc3",
              b"<s>\xff</s>", b"\xef\xbf\xbd literal replacement char"]:
        out.append({"b64": base64.b64encode(b).decode()})
    # Random mixtures (deterministic).
    rng = random.Random(1234)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") + list(" " * 12) +
                list("\n\t\r.,;:!?'\"-_()[]{}<>/\\|@#$%^&*+=~`") +
                ["é", "ñ", "ü", "ß", "你", "好", "日", "本", "한", "글", "م", "ر", "ह", "ि", "ก", "ж", "λ",
                 "\u0301", "\u200d", "👍", "🏽", "❤", "\ufe0f", "🇺", "🇸", "\u00a0", "\u3000", "’", "…",
                 "<s>", "<|im_start|>", "<|endoftext|>", "'s", "'re", "123", "\r\n"])
    for i in range(70):
        n = rng.randint(1, 60)
        out.append({"text": "".join(rng.choice(alphabet) for _ in range(n))})
    # Long inputs (~20 KB).
    out.append({"text": english_text(random.Random(7), 20000)})
    out.append({"text": (CODE + C_CODE) * 40})
    out.append({"text": "a" * 5000})
    out.append({"text": " " * 3000 + "x" + "\n" * 2000})
    out.append({"text": "".join(str(i) for i in range(4000))})
    out.append({"text": ("日本語のテキストと中文文本和한국어 " * 300)})
    out.append({"text": "👍🏽👨‍👩‍👧‍👦" * 400})
    return out


def item_bytes(item):
    return base64.b64decode(item["b64"]) if "b64" in item else item["text"].encode("utf-8")


def item_str(item):
    return item_bytes(item).decode("utf-8", errors="replace")


def llama_like_override(tok, cfg):
    """transformers' Llama/Gemma fast tokenizers: add_bos_token/add_eos_token rebuild the template."""
    cls = cfg.get("tokenizer_class") or ""
    if not ("LlamaTokenizer" in cls or "GemmaTokenizer" in cls):
        return
    if "add_bos_token" not in cfg and "add_eos_token" not in cfg:
        return

    def content(v):
        return v.get("content") if isinstance(v, dict) else v

    bos, eos = content(cfg.get("bos_token")), content(cfg.get("eos_token"))
    single, specials = [], []
    if cfg.get("add_bos_token"):
        single.append(bos)
        specials.append((bos, tok.token_to_id(bos)))
    single.append("$A")
    if cfg.get("add_eos_token"):
        single.append(eos)
        specials.append((eos, tok.token_to_id(eos)))
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)


def make_ref(name, tok, corpus):
    strs = [item_str(it) for it in corpus]
    ids = [tok.encode(s, add_special_tokens=False).ids for s in strs]
    # The template, from a neutral string; then checked for every string.
    plain_a, full_a = tok.encode("a", add_special_tokens=False).ids, tok.encode("a", add_special_tokens=True).ids
    k = next(k for k in range(len(full_a) - len(plain_a) + 1) if full_a[k:k + len(plain_a)] == plain_a)
    prefix, suffix = full_a[:k], full_a[k + len(plain_a):]
    for s, plain in zip(strs, ids):
        if tok.encode(s, add_special_tokens=True).ids != prefix + plain + suffix:
            raise SystemExit(f"{name}: add_special_tokens is not prefix + ids + suffix for {s[:40]!r}")
    dec, dec_skip = [], []
    for it, s, x in zip(corpus, strs, ids):
        d = tok.decode(x, skip_special_tokens=False)
        ds = tok.decode(x, skip_special_tokens=True)
        # null: the decode is the input text itself (never for invalid-UTF-8 inputs).
        dec.append(None if d == s and "text" in it else d)
        dec_skip.append(None if ds == d else ds)
    return {"name": name, "tokenizers_version": tokenizers.__version__, "special_prefix": prefix,
            "special_suffix": suffix, "ids": ids, "decode": dec, "decode_skip": dec_skip}


def write_tiny_spm_gguf(shared, path):
    """A small SentencePiece-style ("llama") GGUF cut from the Llama-2 vocabulary: the first 2000
    pieces plus every single-character piece, scores = -(original id) so the merges that transformers
    and atomc derive from the scores follow Llama-2's order; one USER_DEFINED token. No merges in the
    file (as in llama.cpp's SentencePiece GGUFs)."""
    import gguf
    with open(os.path.join(shared, "tokenizers", "llama2", "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    inv = {v: k for k, v in vocab.items()}
    keep = [i for i in range(len(inv)) if i < 2000 or len(inv[i]) == 1]
    toks, types, scores = [], [], []
    for i in keep:
        toks.append(inv[i])
        types.append(2 if i == 0 else 3 if i in (1, 2) else 6 if 3 <= i < 259 else 1)
        scores.append(0.0 if i < 259 else float(-i))
    toks.append("<tool_call>")
    types.append(4)
    scores.append(0.0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def synth_word_tokenizer(corpus):
    """Components no shipped tokenizer uses: NFKD + Lowercase + Strip + regex Replace normalizers,
    WhitespaceSplit / Digits / Split with MergedWithPrevious, MergedWithNext, Contiguous+invert, a
    trained BPE with unk (fused), continuing_subword_prefix and end_of_word_suffix, added tokens with
    lstrip / rstrip / single_word / normalized, BertProcessing, no decoder."""
    from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=True, continuing_subword_prefix="##",
                                          end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.Lowercase(), normalizers.Strip(),
                                           normalizers.Replace(Regex(r"[0-9]{5,}"), "#")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Split("-", behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"[.,;:!?]"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"[a-z]+"), behavior="contiguous", invert=True)])
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["[UNK]", "[CLS]", "[SEP]"], limit_alphabet=60,
                                  continuing_subword_prefix="##", end_of_word_suffix="</w>", show_progress=False)
    texts = [item_str(it) for it in corpus]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False),
                            AddedToken("<sep>", rstrip=True, special=True, normalized=False)])
    tok.add_tokens([AddedToken("hello", single_word=True, normalized=True), AddedToken("ZZ", normalized=False)])
    from tokenizers import processors
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]")))
    return tok


def synth_meta_tokenizer(shared):
    """A small SentencePiece-style tokenizer.json: Llama-2 pieces (first 2000 + single characters) and
    the merges among them, byte fallback, Metaspace pre-tokenizer (split, prepend always), NFC and a
    regex Replace normalizer, Metaspace + ByteFallback + Fuse decoders, a <s> A </s> template,
    merges given as [a, b] pairs, ignore_merges."""
    with open(os.path.join(shared, "tokenizers", "llama2", "tokenizer.json")) as f:
        j = json.load(f)
    vocab = j["model"]["vocab"]
    inv = {v: k for k, v in vocab.items()}
    keep = [inv[i] for i in range(len(inv)) if i < 2000 or len(inv[i]) == 1]
    new_vocab = {t: i for i, t in enumerate(keep)}
    merges = []
    for m in j["model"]["merges"]:
        a, b = m.split(" ")
        if a in new_vocab and b in new_vocab and a + b in new_vocab:
            merges.append([a, b])
    out = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFC"}, {"type": "Replace", "pattern": {"Regex": "\\t+"}, "content": " "}]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                      {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                                              "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": True,
                  "vocab": new_vocab, "merges": merges},
    }
    return json.dumps(out, ensure_ascii=False)


def write_tiny_bpe_gguf(shared, path, pre):
    """A small byte-level ("gpt2") GGUF cut from the Qwen3 vocabulary (first 6000 tokens, the merges
    among them, three CONTROL tokens and one USER_DEFINED), with tokenizer.ggml.pre = pre."""
    import gguf
    with open(os.path.join(shared, "tokenizers", "qwen3", "tokenizer.json")) as f:
        j = json.load(f)
    vocab = j["model"]["vocab"]
    inv = {v: k for k, v in vocab.items()}
    toks = [inv[i] for i in range(6000)]
    keep = set(toks)
    merges = [f"{a} {b}" for a, b in j["model"]["merges"] if a in keep and b in keep and a + b in keep]
    types = [1] * len(toks)
    for extra, ty in (("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4)):
        toks.append(extra)
        types.append(ty)
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(6000)
    w.add_eos_token_id(6002)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def synth_bytelevel_tokenizer(shared):
    """Byte-level components the real files leave out: NFKC normalizer, a literal-String Split with
    Removed behaviour, individual Digits, ByteLevel with add_prefix_space and its own GPT-2 regex,
    normalized and single_word added tokens, a <|endoftext|> A <|endoftext|> template, decoders
    ByteLevel + Strip. Vocabulary: Qwen3's first 6000 tokens and the merges among them."""
    with open(os.path.join(shared, "tokenizers", "qwen3", "tokenizer.json")) as f:
        j = json.load(f)
    inv = {v: k for k, v in j["model"]["vocab"].items()}
    vocab = {inv[i]: i for i in range(6000)}
    merges = [[a, b] for a, b in j["model"]["merges"] if a in vocab and b in vocab and a + b in vocab]
    added = [(6000, "<|endoftext|>", True, False, False), (6001, "<tag>", False, True, False),
             (6002, "hello", False, True, True)]
    out = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": sw, "lstrip": False, "rstrip": False,
                          "normalized": norm, "special": sp} for i, c, sp, norm, sw in added],
        "normalizer": {"type": "NFKC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": "||"}, "behavior": "Removed", "invert": False},
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}},
                                      {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [6000],
                                                                "tokens": ["<|endoftext|>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},  # stop>0 panics in HF on an empty text
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    return json.dumps(out, ensure_ascii=False)


def write_tiny_dsv3(shared, gguf_path, json_path):
    """tokenizer.ggml.pre = "deepseek-v3": transformers' GGUF conversion has no entry for it (it would
    fall back to GPT-2's regex), so the reference here is DeepSeek-V3's own pre-tokenizer from its
    tokenizer.json, on a small vocabulary (DeepSeek's first 6000 tokens plus the byte alphabet, the
    merges among them); the same vocabulary goes into a "gpt2" GGUF that atomc loads."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    with open(os.path.join(shared, "tokenizers", "deepseek_v3", "tokenizer.json")) as f:
        j = json.load(f)
    vocab = j["model"]["vocab"]
    inv = {v: k for k, v in vocab.items()}
    alphabet = set(bytes_to_unicode().values())
    keep = [inv[i] for i in sorted(inv) if i < 6000 or (len(inv[i]) == 1 and inv[i] in alphabet)]
    new_vocab = {t: i for i, t in enumerate(keep)}
    merges = [m for m in j["model"]["merges"] if (lambda a, b: a in new_vocab and b in new_vocab and a + b in new_vocab)(*m.split(" "))]
    control = [a["content"] for a in j["added_tokens"] if a["content"] in new_vocab and a["special"]]
    ref = dict(j)
    ref["added_tokens"] = [{"id": new_vocab[c], "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for c in control]
    ref["normalizer"] = None
    ref["post_processor"] = None
    ref["model"] = dict(j["model"], vocab=new_vocab, merges=merges)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False)
    w = gguf.GGUFWriter(gguf_path, "deepseek2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-v3")
    w.add_token_list(keep)
    w.add_token_types([3 if t in control else 1 for t in keep])
    w.add_token_merges(merges)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_reference(path):
    import warnings
    warnings.filterwarnings("ignore")
    from transformers import AutoTokenizer
    at = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return tokenizers.Tokenizer.from_str(at.backend_tokenizer.to_str())


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        # One corpus entry / id list per line keeps diffs readable and the files compact.
        if isinstance(obj, list):
            f.write("[\n" + ",\n".join(json.dumps(x, ensure_ascii=False, separators=(",", ":")) for x in obj) + "\n]\n")
            return
        f.write("{\n")
        keys = list(obj)
        for i, k in enumerate(keys):
            v = obj[k]
            if isinstance(v, list) and k in ("ids", "decode", "decode_skip"):
                body = ",\n".join(json.dumps(x, ensure_ascii=False, separators=(",", ":")) for x in v)
                f.write(f"{json.dumps(k)}:[\n{body}\n]")
            else:
                f.write(f"{json.dumps(k)}:{json.dumps(v, ensure_ascii=False, separators=(',', ':'))}")
            f.write(",\n" if i + 1 < len(keys) else "\n")
        f.write("}\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.environ.get("ATOMC_SHARED", os.path.join(ROOT, "..", "shared")))
    ap.add_argument("--smollm2", default=os.environ.get("ATOMC_SMOLLM2",
                                                        "/root/.cache/atomc/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    corpus = corpus_items()
    assert len(corpus) >= 200, len(corpus)
    write_json(os.path.join(OUT, "corpus.json"), corpus)
    for name in NAMES:
        d = os.path.join(args.shared, "tokenizers", name)
        tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        cfg_path = os.path.join(d, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                llama_like_override(tok, json.load(f))
        write_json(os.path.join(OUT, f"ref_{name}.json"), make_ref(name, tok, corpus))
        print("wrote", name, file=sys.stderr)
    word = synth_word_tokenizer(corpus)
    word.save(os.path.join(OUT, "synth_word.json"))
    write_json(os.path.join(OUT, "ref_synth_word.json"), make_ref("synth_word", word, corpus))
    meta_path = os.path.join(OUT, "synth_meta.json")
    with open(meta_path, "w", encoding="utf-8") as f:
        f.write(synth_meta_tokenizer(args.shared))
    write_json(os.path.join(OUT, "ref_synth_meta.json"),
               make_ref("synth_meta", tokenizers.Tokenizer.from_file(meta_path), corpus))
    bl_path = os.path.join(OUT, "synth_bytelevel.json")
    with open(bl_path, "w", encoding="utf-8") as f:
        f.write(synth_bytelevel_tokenizer(args.shared))
    write_json(os.path.join(OUT, "ref_synth_bytelevel.json"),
               make_ref("synth_bytelevel", tokenizers.Tokenizer.from_file(bl_path), corpus))
    print("wrote synthetic tokenizers", file=sys.stderr)
    for pre in ("qwen2", "llama-bpe"):
        name = "tiny_bpe_" + pre.replace("-", "_")
        p = os.path.join(OUT, name + ".gguf")
        write_tiny_bpe_gguf(args.shared, p, pre)
        write_json(os.path.join(OUT, f"ref_{name}.json"), make_ref(name, gguf_reference(p), corpus))
        print("wrote", name, file=sys.stderr)
    ds_json = "/tmp/atomc_tiny_dsv3_reference.json"  # the reference tokenizer; not a fixture
    write_tiny_dsv3(args.shared, os.path.join(OUT, "tiny_dsv3.gguf"), ds_json)
    write_json(os.path.join(OUT, "ref_tiny_dsv3.json"),
               make_ref("tiny_dsv3", tokenizers.Tokenizer.from_file(ds_json), corpus))
    print("wrote tiny_dsv3", file=sys.stderr)
    spm = os.path.join(OUT, "tiny_spm.gguf")
    write_tiny_spm_gguf(args.shared, spm)
    write_json(os.path.join(OUT, "ref_tiny_spm.json"), make_ref("tiny_spm", gguf_reference(spm), corpus))
    print("wrote tiny_spm", file=sys.stderr)
    if args.smollm2 and os.path.exists(args.smollm2):
        tok = gguf_reference(args.smollm2)
        write_json(os.path.join(OUT, "ref_smollm2.json"), make_ref("smollm2", tok, corpus))
        print("wrote smollm2", file=sys.stderr)
    else:
        print("SmolLM2 GGUF not found; ref_smollm2.json not regenerated", file=sys.stderr)


if __name__ == "__main__":
    main()
