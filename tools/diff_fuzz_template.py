#!/usr/bin/env python3
"""Differential fuzzing of atomc's Jinja interpreter against jinja2 (HF's environment).

Generates random templates from a small grammar (expressions over JSON-like variables,
filters, tests, methods, statements, whitespace-control markers, text with spaces and
newlines), renders each with Python jinja2 and with `atomc chat-template`, and reports
every case where the outputs differ or only one side fails. Not a CI test (it is random);
run it after changing the interpreter:

    python3 tools/diff_fuzz_template.py --n 2000 [--seed 1] [--atomc build/atomc]
"""
import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from template_snippets import V  # noqa: E402
from transformers.utils.chat_template_utils import _compile_jinja_template  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]

ATOMS = ["s", "u", "n", "f", "neg", "t", "no", "xs", "names", "d", "msgs", "big", "tiny", "whole", "e", "ws",
         "zz", "1", "0", "-3", "2.5", "'abc'", "'a b'", "''", "' x '", "none", "true", "false", "[1, 2]", "[]",
         "{'k': 1}", "(1, 'a')", "msgs[0]", "d.a", "d['b']", "xs[1:]", "s[::-1]", "u[2]", "loop_var"]
FILTERS = ["trim", "length", "upper", "lower", "capitalize", "title", "string", "tojson", "list", "first", "last",
           "int", "float", "abs", "reverse", "sort", "unique", "join", "join(', ')", "default('D')",
           "default('D', true)", "replace('a', 'X')", "items", "tojson(indent=2)", "map('string')", "select",
           "reject", "sum", "min", "max", "count", "safe", "round", "round(1)", "e", "wordcount", "indent(2)",
           "map(attribute='role') | list", "selectattr('role', 'equalto', 'user') | list", "dictsort",
           "list | length"]
# jinja2 returns generators from these; atomc returns lists (same items), so compare through | list
FILTERS = [f + " | list" if f.split("(")[0] in ("unique", "select", "reject", "map") else f for f in FILTERS]
TESTS = ["defined", "undefined", "none", "string", "number", "mapping", "iterable", "sequence", "integer", "float",
         "boolean", "true", "false", "odd", "even", "equalto 1", "in [1, 'abc']", "lower", "upper", "gt 1"]
METHODS = ["strip()", "upper()", "lower()", "split()", "split(',')", "startswith('a')", "endswith('b')",
           "replace('l', 'L')", "title()", "lstrip('h')", "rstrip()", "find('o')", "count('l')", "items()",
           "get('a')", "keys()", "values()", "index(1)", "splitlines()", "capitalize()", "isdigit()"]
BINOPS = ["+", "-", "*", "/", "//", "%", "~", "==", "!=", "<", ">", "<=", ">=", "in", "not in", "and", "or", "**"]


def expr(r, depth=0):
    k = r.random()
    if depth > 3 or k < 0.3:
        return r.choice(ATOMS)
    if k < 0.5:
        return f"{expr(r, depth + 1)} | {r.choice(FILTERS)}"
    if k < 0.6:
        neg = r.choice(["", "not "])
        return f"{expr(r, depth + 1)} is {neg}{r.choice(TESTS)}"
    if k < 0.72:
        return f"({expr(r, depth + 1)}).{r.choice(METHODS)}"
    if k < 0.9:
        return f"({expr(r, depth + 1)} {r.choice(BINOPS)} {expr(r, depth + 1)})"
    if k < 0.95:
        return f"({expr(r, depth + 1)} if {expr(r, depth + 1)} else {expr(r, depth + 1)})"
    return f"[{expr(r, depth + 1)}, {expr(r, depth + 1)}]"


def text(r):
    return r.choice(["", " ", "\n", "  \n", "x", " y ", "\n  ", "\t", "a\n\nb", "  ", "\n\n"])


def ws(r):
    return r.choice(["", "", "-", "+"])


def stmt(r, depth=0):
    k = r.random()
    o, c = "{%" + ws(r) + " ", " " + ws(r) + "%}"
    if depth > 2 or k < 0.35:
        return text(r) + "{{" + ws(r) + " " + expr(r) + " " + ws(r) + "}}" + text(r)
    if k < 0.55:
        body = "".join(stmt(r, depth + 1) for _ in range(r.randint(1, 3)))
        els = (o + "else" + c + stmt(r, depth + 1)) if r.random() < 0.4 else ""
        return f"{text(r)}{o}if {expr(r)}{c}{body}{els}{o}endif{c}{text(r)}"
    if k < 0.75:
        body = "".join(stmt(r, depth + 1) for _ in range(r.randint(1, 3)))
        body += r.choice(["", "{{ loop.index }}", "{{ loop.first }}{{ loop.last }}", "{{ loop.revindex0 }}"])
        it = r.choice(["xs", "names", "msgs", "d", "s", "[]", "range(3)", "d.items()", expr(r)])
        cond = f" if {expr(r)}" if r.random() < 0.2 else ""
        return f"{text(r)}{o}for loop_var in {it}{cond}{c}{body}{o}endfor{c}{text(r)}"
    if k < 0.85:
        return f"{text(r)}{o}set zz = {expr(r)}{c}{text(r)}"
    if k < 0.92:
        return f"{o}set ns = namespace(v={expr(r)}){c}{o}set ns.v = ns.v ~ {expr(r)}{c}{{{{ ns.v }}}}"
    return f"{text(r)}{{#{ws(r)} comment {ws(r)}#}}{text(r)}"


def gen(r):
    return "".join(stmt(r) for _ in range(r.randint(1, 4))) + r.choice(["", "\n", "\n\n"])


def gen_ws(r):
    """Whitespace-control stress: random text and tags with -/+ markers, no expressions."""
    def t():
        return "".join(r.choice([" ", "  ", "\t", "\n", "\n\n", "x", "y ", " z\n", "\r\n", "\u00a0", "\u3000"])
                       for _ in range(r.randint(0, 4)))

    def m():
        return r.choice(["", "", "-", "+"])

    def block(depth):
        out = []
        for _ in range(r.randint(1, 4)):
            k = r.random()
            if k < 0.25 or depth > 2:
                out.append(t() + "{{" + m() + " " + r.choice(["n", "'a'", "' b '", "e", "'\\n'"]) + " " + m() + "}}")
            elif k < 0.45:
                out.append(t() + "{%" + m() + " if " + r.choice(["true", "false", "n"]) + " " + m() + "%}" + block(depth + 1)
                           + (t() + "{%" + m() + " else " + m() + "%}" + block(depth + 1) if r.random() < 0.3 else "")
                           + t() + "{%" + m() + " endif " + m() + "%}")
            elif k < 0.6:
                out.append(t() + "{%" + m() + " for i in xs " + m() + "%}" + block(depth + 1) + t() + "{%" + m() + " endfor "
                           + m() + "%}")
            elif k < 0.72:
                out.append(t() + "{#" + m() + " c " + m() + "#}")
            elif k < 0.8:
                out.append(t() + "{%" + m() + " raw " + m() + "%}" + t() + "{{ x }}" + t() + "{%" + m() + " endraw " + m() + "%}")
            elif k < 0.9:
                out.append(t() + "{%" + m() + " set v = 1 " + m() + "%}")
            else:
                out.append(t() + "{%" + m() + " set v " + m() + "%}" + block(depth + 1) + "{%" + m() + " endset " + m() + "%}{{ v }}")
        return "".join(out) + t()

    return block(0) + r.choice(["", "\n", "\n\n", "\r\n"])


def jinja_render(src):
    try:
        return _compile_jinja_template(src).render(messages=MESSAGES, tools=None, documents=None,
                                                   add_generation_prompt=False, **copy.deepcopy(V)), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--atomc", default="build/atomc")
    ap.add_argument("--show", type=int, default=10)
    ap.add_argument("--mode", choices=["expr", "ws"], default="expr", help="expressions+statements, or whitespace control")
    args = ap.parse_args()
    r = random.Random(args.seed)
    tmp = tempfile.mkdtemp()
    tpl_path, msg_path = os.path.join(tmp, "t.jinja"), os.path.join(tmp, "m.json")
    json.dump(MESSAGES, open(msg_path, "w"))
    kwargs = json.dumps(V)
    bad = 0
    for i in range(args.n):
        src = gen(r) if args.mode == "expr" else gen_ws(r)
        want, err = jinja_render(src)
        with open(tpl_path, "w", newline="") as fh:
            fh.write(src)
        p = subprocess.run([args.atomc, "chat-template", "--chat-template", tpl_path, "--messages", msg_path,
                            "--kwargs", kwargs], capture_output=True)
        got = p.stdout.decode() if p.returncode == 0 else None
        if (want is None) != (got is None) or (want is not None and want != got):
            bad += 1
            if bad <= args.show:
                print(f"--- case {i}\n{src!r}\n  jinja2: {want!r} {err or ''}\n  atomc:  {got!r} "
                      f"{p.stderr.decode().strip() if p.returncode else ''}")
    print(f"{args.n} templates, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
