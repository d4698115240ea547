"""min_tokens: EOS and stop token ids are banned from sampling until min_tokens outputs exist (vLLM's
rule), so the model cannot emit them early; afterwards they stop the request as usual."""
import json
import os
import subprocess

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
TINY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "llama_gqa")


def gen(*extra):
    out = subprocess.run([ATOMC, "generate", "--model", TINY, "--prompt-ids", "5,6,7,8,9", "--temperature", "0",
                          "--json", *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_stop_id_is_banned_before_min_tokens():
    free = gen("--max-tokens", "8", "--ignore-eos")
    t0 = free["ids"][0]
    # Without min_tokens the greedy first token is the stop id: the request stops at once.
    stopped = gen("--max-tokens", "8", "--ignore-eos", "--stop-token-id", str(t0))
    assert stopped["ids"] == [t0] and stopped["finish_reason"] == "stop"
    # With min_tokens 4 it cannot be sampled in the first 4 tokens.
    r = gen("--max-tokens", "8", "--ignore-eos", "--stop-token-id", str(t0), "--min-tokens", "4")
    assert len(r["ids"]) >= 4
    assert t0 not in r["ids"][:4]
    assert r["ids"][0] != t0
