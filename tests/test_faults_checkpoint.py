"""Issue 14 (faults), training side: non-finite / exploding weights are never checkpointed,
and resume survives a torn metrics line, a corrupt latest checkpoint and a truncated
pre-sampling chunk. Each test reproduced its fault before the fix."""
import json
import os

import pytest
import torch

from openrlhf_div.engines.local.checkpoint import CorruptCheckpointError, NonFiniteWeightsError
from openrlhf_div.engines.local.config import load_config
from openrlhf_div.io import atomic_write_jsonl
from openrlhf_div.engines.local.presample import presample
from openrlhf_div.engines.local.models import load_model
from openrlhf_div.engines.local.trainer import Trainer, train
from openrlhf_div.tasks.base import RewardResult, Task, register_task

torch.set_num_threads(1)
VOCAB = "abcdef="


class FaultCopyLast(Task):
    name = "test_fault_copy"

    def prompt(self, example):
        return example["prompt"]

    def score(self, response, label):
        ok = response[:1] == label
        return RewardResult(float(ok), ok)


register_task("test_fault_copy", lambda **kw: FaultCopyLast())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(24):
        s = "".join("abcdef"[int(j)] for j in torch.randint(0, 6, (3,), generator=g))
        rows.append({"prompt": s + "=", "label": s[-1], "source": "t", "id": f"e{i}"})
    atomic_write_jsonl(str(d / "train.jsonl"), rows)
    return d


def _ov(data_dir, out, *extra):
    return ["task=test_fault_copy", f"output_dir={out}", f"model.tiny_vocab={VOCAB}",
            f"data.train={data_dir / 'train.jsonl'}", "rollout.prompts_per_step=2", "rollout.group_size=4",
            "rollout.max_new_tokens=3", "optim.steps=2", "optim.learning_rate=1e-2", "eval.at_start=false",
            "logging.tensorboard=false", "logging.progress=false", "checkpoint.every=1", "method.name=grpo", *extra]


def _all_finite(model_dir):
    m, _ = load_model(str(model_dir))
    return all(torch.isfinite(v).all() for v in m.state_dict().values())


# ------------------------------------------------------------------ 4. non-finite weights
def test_infinite_learning_rate_never_checkpoints_non_finite_weights(data_dir, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(NonFiniteWeightsError, match=r"non-finite weights .* at step 1 .*Last good checkpoint: none"):
        train(overrides=_ov(data_dir, run, "optim.learning_rate=inf", "optim.steps=3"))
    ck = run / "checkpoints"
    assert not (ck / "latest").exists()
    assert not ck.exists() or not [d for d in os.listdir(ck) if d.startswith("step_")]


def test_weights_poisoned_mid_run_stop_naming_the_last_good_checkpoint_which_resume_uses(data_dir, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, _ov(data_dir, run, "optim.steps=4"))

    def hook(e):  # step 3's optimizer step makes every weight inf
        if e["step"] == 3:
            for g in e["trainer"].optimizer.param_groups:
                g["lr"] = float("inf")

    tr = Trainer(cfg, hooks=[hook])
    with pytest.raises(NonFiniteWeightsError, match=r"at step 3 .*Last good checkpoint: .*step_000002"):
        tr.train()
    ck = run / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_000002"
    assert not (ck / "step_000003").exists()
    assert _all_finite(ck / "step_000002" / "model")
    out = train(resume=str(run), overrides=["optim.steps=3"])  # the saved optimizer state has the good lr
    assert out["metrics"]["step"] == 3


def test_exploding_weights_stop_the_run(data_dir, tmp_path):
    """lr=1e6 kept the weights finite (up to 3.8e6) and exited 0: now it stops, unsaved."""
    with pytest.raises(NonFiniteWeightsError, match=r"exploding weights .*max_weight_growth=100"):
        train(overrides=_ov(data_dir, tmp_path / "run", "optim.learning_rate=1e6", "optim.steps=3"))
    ck = tmp_path / "run" / "checkpoints"
    if (ck / "latest").exists():  # a step whose groups were all equal moved nothing and was saved: still sane
        m, _ = load_model(str(ck / (ck / "latest").read_text().strip() / "model"))
        assert max(float(v.abs().max()) for v in m.state_dict().values()) < 100


# ------------------------------------------------------------------ 5. resume robustness
def test_torn_last_metrics_line_is_dropped_with_a_warning(data_dir, tmp_path):
    run = tmp_path / "run"
    train(overrides=_ov(data_dir, run))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_mean": 0.')  # what a kill mid-write leaves
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: dropped a torn last line"):
        out = train(resume=str(run), overrides=["optim.steps=3"])
    assert out["metrics"]["step"] == 3
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_bad_metrics_line_in_the_middle_names_file_and_line(data_dir, tmp_path):
    run = tmp_path / "run"
    train(overrides=_ov(data_dir, run))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("{broken\n" + "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not valid JSON"):
        train(resume=str(run), overrides=["optim.steps=3"])


def test_corrupt_latest_checkpoint_is_named_and_resume_falls_back(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    train(overrides=_ov(data_dir, run))
    ck = run / "checkpoints"
    assert json.loads((ck / "step_000002" / "manifest.json").read_text())["files"]
    st = ck / "step_000002" / "trainer_state.pt"
    st.write_bytes(st.read_bytes()[:100])  # truncated
    out = train(resume=str(run), overrides=["optim.steps=3"])
    said = capsys.readouterr().out
    assert "step_000002 is corrupt" in said and "trainer_state.pt" in said and "100 bytes" in said
    assert "resuming from the previous intact checkpoint" in said and "step_000001" in said
    assert out["metrics"]["step"] == 3
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # step 2 redone, logged once


def test_fallback_points_latest_at_the_intact_checkpoint(data_dir, tmp_path):
    from openrlhf_div.engines.local.checkpoint import resume_checkpoint

    run = tmp_path / "run"
    train(overrides=_ov(data_dir, run))
    ck = run / "checkpoints"
    (ck / "step_000002" / "trainer_state.pt").write_bytes(b"")
    said = []
    assert resume_checkpoint(str(ck), say=said.append) == str(ck / "step_000001")
    assert (ck / "latest").read_text().strip() == "step_000001"  # error messages name the last good one
    assert any("step_000002 is corrupt" in m for m in said)


def test_no_intact_checkpoint_is_an_error_naming_the_file(data_dir, tmp_path):
    run = tmp_path / "run"
    train(overrides=_ov(data_dir, run, "checkpoint.keep=1"))
    model_dir = run / "checkpoints" / "step_000002" / "model"
    w = next(p for p in model_dir.iterdir() if p.suffix == ".safetensors")
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF  # same size, one flipped byte
    w.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors: checksum differs"):
        train(resume=str(run), overrides=["optim.steps=3"])


def test_truncated_presample_chunk_is_named_and_recomputed(data_dir, tmp_path, capsys):
    cfg = load_config(None, _ov(data_dir, tmp_path / "run", "presample.n_pre=2", "presample.chunk_size=8"))
    ref = presample(cfg, str(tmp_path / "ref"), progress=False)
    assert ref["complete"]
    out = tmp_path / "ps"
    presample(cfg, str(out), progress=False, max_new_chunks=2)
    chunk = out / "shards" / "chunk_000001.json"
    chunk.write_bytes(chunk.read_bytes()[: len(chunk.read_bytes()) // 2])
    s = presample(cfg, str(out), progress=False)
    said = capsys.readouterr().out
    assert "chunk_000001.json" in said and "recomput" in said
    assert s["complete"]
    for name in ("d_pef.jsonl", "d_exp.jsonl"):
        assert (out / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
