#!/usr/bin/env python3
"""Check any chat template against jinja2 (HF's environment) with the golden conversation set.

Renders every conversation of tools/gen_template_refs.py with Python jinja2 and with
`atomc chat-template --chat-template FILE`, and reports differences (or cases where only
one side fails). Use it when adding support for a new model's template:

    python3 tools/check_template.py path/to/chat_template.jinja [more.jinja ...] \
        [--atomc build/atomc] [--bos '<s>'] [--eos '</s>']
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_template_refs as refs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("templates", nargs="+")
    ap.add_argument("--atomc", default="build/atomc")
    ap.add_argument("--bos", default="<s>")
    ap.add_argument("--eos", default="</s>")
    ap.add_argument("--show", type=int, default=4)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    total_bad = 0
    for path in args.templates:
        tpl = open(path, encoding="utf-8").read()
        bad = 0
        for case in refs.cases():
            try:
                want, err = refs.render(tpl, case, args.bos, args.eos), None
            except Exception as e:
                want, err = None, f"{type(e).__name__}: {e}"
            with open(os.path.join(tmp, "m.json"), "w") as fh:
                json.dump(case["messages"], fh)
            cmd = [args.atomc, "chat-template", "--chat-template", path, "--messages", os.path.join(tmp, "m.json"),
                   "--bos", args.bos, "--eos", args.eos]
            if case.get("tools"):
                with open(os.path.join(tmp, "t.json"), "w") as fh:
                    json.dump(case["tools"], fh)
                cmd += ["--tools", os.path.join(tmp, "t.json")]
            if case.get("add_generation_prompt"):
                cmd.append("--add-generation-prompt")
            if case.get("continue_final_message"):
                cmd.append("--continue-final-message")
            if case.get("kwargs"):
                cmd += ["--kwargs", json.dumps(case["kwargs"])]
            p = subprocess.run(cmd, capture_output=True)
            got = p.stdout.decode() if p.returncode == 0 else None
            if (want is None) != (got is None) or (want is not None and want != got):
                bad += 1
                if bad <= args.show:
                    print(f"--- {os.path.basename(path)} {case['name']}\n  jinja2: {want!r} {err or ''}\n"
                          f"  atomc:  {got!r} {p.stderr.decode().strip()}")
        print(f"{path}: {len(refs.cases())} conversations, {bad} mismatches")
        total_bad += bad
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
