"""lm-eval-harness scores a multiple-choice task through `atomc serve` (local-completions with the
server's own tokenizer: tokenizer_backend=remote -> /tokenizer_info, /tokenize, /detokenize), and
the loglikelihoods it reads from atomc's prompt logprobs (echo + logprobs) match HF transformers
on the same model (tests/fixtures/lmeval/ref.json, made by tools/gen_lmeval_ref.py)."""
import glob
import json
import os
import subprocess
import sys

import pytest

from server_util import SMOLLM2, Server

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "fixtures", "lmeval")

pytestmark = pytest.mark.skipif(not SMOLLM2, reason="ATOMC_SMOLLM2 not set")


def test_lm_eval_multiple_choice_matches_hf(tmp_path):
    pytest.importorskip("lm_eval")
    ref = json.load(open(os.path.join(FIX, "ref.json")))
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "atomc_mc.yaml").write_text(
        "task: atomc_mc\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {os.path.abspath(os.path.join(FIX, 'atomc_mc.jsonl'))}\n"
        "output_type: multiple_choice\n"
        "test_split: test\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    srv = Server(SMOLLM2, "--served-model-name", "smollm2")
    try:
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   HF_DATASETS_CACHE=str(tmp_path / "hfcache"))
        out = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"model=smollm2,base_url={srv.base}/v1/completions,tokenizer_backend=remote,num_concurrent=4,"
             "max_retries=1,tokenized_requests=True",
             "--tasks", "atomc_mc", "--include_path", str(task_dir), "--output_path", str(tmp_path / "out"),
             "--log_samples"],
            capture_output=True, text=True, timeout=900, env=env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finally:
        assert srv.stop() == 0
    samples = glob.glob(str(tmp_path / "out" / "**" / "samples_atomc_mc_*.jsonl"), recursive=True)
    assert samples, out.stdout[-2000:]
    got = [json.loads(l) for l in open(samples[0])]
    assert len(got) == len(ref)
    worst = 0.0
    for s in got:
        r = ref[s["doc_id"]]
        assert len(s["resps"]) == len(r["ref"])
        for resp, rr in zip(s["resps"], r["ref"]):
            ll, greedy = resp[0]
            worst = max(worst, abs(float(ll) - rr["loglikelihood"]))
            assert abs(float(ll) - rr["loglikelihood"]) < 2e-3 * max(1.0, abs(rr["loglikelihood"])), (s["doc_id"], ll, rr)
            # lm-eval's sample log stores is_greedy as a string ("True"/"False")
            assert str(greedy) == str(rr["is_greedy"]), (s["doc_id"], greedy, rr["is_greedy"])
    print("max |loglikelihood - HF| =", worst)
