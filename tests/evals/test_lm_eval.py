"""A real client end to end: lm-evaluation-harness scores a multiple-choice task (loglikelihoods:
completions with `echo` + `logprobs`) through `kvtier serve` with its `local-completions` model, and
with its `hf` backend on the same SmolLM2 weights. Same accuracy, same per-choice loglikelihoods.

Nothing comes from a hub: the task and its data ship in lm_eval_task/, the tokenizer is the converted
SmolLM2 directory (`tokenizer_backend=huggingface` with a local path; `tokenizer_backend=None` cannot
serve loglikelihood requests: lm-eval needs token counts to find the continuation), and the test runs
with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_support import free_port  # noqa: E402

TASK_DIR = Path(__file__).parent / "lm_eval_task"
pytestmark = pytest.mark.smollm2


@pytest.fixture
def offline(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.chdir(TASK_DIR)  # the task's data_files are relative


@pytest.fixture
def kvtier_serve(smollm2, tmp_path):
    """`kvtier serve` on SmolLM2 in its own process; yields its completions URL."""
    port = free_port()
    env = {**os.environ, "KVTIER_CACHE_DIR": str(Path(smollm2.model.name_or_path).parent)}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "kvtier"), "serve", "--model", "smollm2", "--no-tiers",
                             "--port", str(port), "--served-model-name", "smollm2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        healthy = False
        for _ in range(3000):  # bounded: imports + model load on a busy machine
            assert proc.poll() is None, proc.stdout.read()
            with contextlib.suppress(httpx.TransportError):
                healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            if healthy:
                break
            time.sleep(0.1)
        assert healthy, "kvtier serve never answered /health"
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def evaluate(model: str, model_args: str) -> tuple[dict, list[list[tuple[float, bool]]]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["kvtier_mc"], batch_size=1,
                                  task_manager=TaskManager(include_path=str(TASK_DIR)), log_samples=True)
    samples = sorted(out["samples"]["kvtier_mc"], key=lambda s: s["doc_id"])
    return out["results"]["kvtier_mc"], [[(float(lp), bool(greedy)) for lp, greedy in s["filtered_resps"]]
                                         for s in samples]


def test_lm_eval_through_kvtier_serve_equals_its_hf_backend(smollm2, offline, kvtier_serve):
    weights = smollm2.model.name_or_path  # the converted directory (config, safetensors, tokenizer)
    served, served_choices = evaluate("local-completions", f"model=smollm2,base_url={kvtier_serve},"
                                      f"tokenizer_backend=huggingface,tokenizer={weights},tokenized_requests=True,"
                                      "num_concurrent=1,max_retries=1")
    hf, hf_choices = evaluate("hf", f"pretrained={weights},dtype=float32,device=cpu")
    print(f"lm-eval kvtier_mc: served acc {served['acc,none']} acc_norm {served['acc_norm,none']}; "
          f"hf acc {hf['acc,none']} acc_norm {hf['acc_norm,none']}")
    assert served["sample_len"] == hf["sample_len"] == 40
    assert hf["acc,none"] > 0.5  # the task discriminates (chance is 0.25)
    for metric in ("acc,none", "acc_norm,none"):
        assert abs(served[metric] - hf[metric]) * 100 <= 0.5, metric
    diffs = [abs(a[0] - b[0]) for sa, sb in zip(served_choices, hf_choices) for a, b in zip(sa, sb)]
    assert len(diffs) == 160 and max(diffs) < 1e-3, max(diffs)
    assert [[g for _, g in s] for s in served_choices] == [[g for _, g in s] for s in hf_choices]
