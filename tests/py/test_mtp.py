"""The MTP references of tests/fixtures/models/{deepseek_v3,glm4_moe}_mtp/mtp_refs.json (which tests/test_mtp.c
holds atomc's MTP logits and chained drafts to) recomputed here from the committed weights with
HF's own modules (DeepseekV3DecoderLayer / Glm4MoeDecoderLayer, their RMSNorm, the model's rotary embedding; see
tools/make_tiny_mtp.py), so the stored references cannot drift from the fixture: logits at every
position of every prompt and the k = 3 greedy chain."""
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))
FIX = os.path.join(ROOT, "tests", "fixtures", "models")


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_refs_are_the_hf_module_forward(arch):
    from make_tiny_mtp import load_fixture, mtp_forward
    torch.set_num_threads(1)
    d = os.path.join(FIX, arch + "_mtp")
    model, mtp = load_fixture(d, arch)
    with open(os.path.join(d, "mtp_refs.json")) as f:
        refs = json.load(f)
    worst = 0.0
    with torch.no_grad():
        for p in refs["prompts"]:
            ids = p["ids"]
            n = len(ids)
            h = model.model(torch.tensor([ids])).last_hidden_state[0]
            t_n = int(model.lm_head(h[-1]).argmax())
            assert t_n == p["target_next"]
            tokens = ids[1:] + [t_n]
            out, logits = mtp_forward(model, mtp, tokens, h)
            worst = max(worst, float((logits - torch.tensor(p["mtp_logits"])).abs().max()))
            hidden = h
            for j, (d, margin) in enumerate(zip(p["chain"], p["chain_margins"])):
                row = logits[n - 1 + j]
                if margin >= 1e-3:
                    assert int(row.argmax()) == d
                tokens = tokens + [d]
                hidden = torch.cat([hidden, out[n - 1 + j].view(1, -1)], 0)
                out, logits = mtp_forward(model, mtp, tokens, hidden)
    assert worst < 1e-4, worst
