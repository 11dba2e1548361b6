"""The local run's logs (JSONL, TensorBoard, optional Weights & Biases), the step metrics
(structured, no string-encoded keys) and the Ctrl-C helper, each on its own."""
from __future__ import annotations

import json
import sys
import types

import pytest

from openrlhf_div.engines.local.interrupt import GracefulInterrupt
from openrlhf_div.engines.local.runlog import WANDB_ENV, RunLog, WandbMissingError, scalars
from openrlhf_div.engines.local.step_metrics import StepMetrics


def test_step_metrics_add_loss_parts_within_an_optimizer_step_and_average_the_rest():
    acc = StepMetrics()
    acc.add_micro_batch({"loss": 0.25, "loss_exp": 0.5, "clip_frac": 0.1})
    acc.add_micro_batch({"loss": 0.25, "clip_frac": 0.3})
    acc.add_mean("grad_norm", 2.0)
    acc.end_optimizer_step()
    acc.add_micro_batch({"loss": 1.0, "clip_frac": 0.2})
    acc.add_mean("grad_norm", 4.0)
    acc.end_optimizer_step()
    out = acc.result()
    assert out["loss"] == pytest.approx((0.5 + 1.0) / 2)   # summed within a step, mean over steps
    assert out["loss_exp"] == pytest.approx(0.5 / 2)        # only in the first step
    assert out["clip_frac"] == pytest.approx(0.2) and out["grad_norm"] == 3.0
    assert out["optimizer_steps"] == 2.0 and not any("@" in k for k in out)


def test_jsonl_truncation_and_scalars(tmp_path):
    log = RunLog(str(tmp_path), tensorboard=False)
    for s in (1, 2, 3):
        log.append("metrics.jsonl", {"step": s, "x": s})
    log.truncate("metrics.jsonl", 2)
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2]
    assert scalars({"a": 1, "b": {"c": 2.0, "d": "s"}, "e": float("nan"), "f": True}) == {"a": 1.0, "b/c": 2.0}
    log.close()


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(WANDB_ENV, "proj")
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
    with pytest.raises(WandbMissingError, match="pip install wandb"):
        RunLog(str(tmp_path))


def test_wandb_calls_when_asked_for(tmp_path, monkeypatch):
    """wandb is not installed here: a recording stand-in checks what RunLog hands it."""
    calls = []

    class Run:
        def log(self, d, step):
            calls.append(("log", d, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv(WANDB_ENV, "proj")
    log = RunLog(str(tmp_path), tensorboard=False, run_name="grpo")
    log.scalars("train", {"step": 3, "loss": 0.5, "pass_at_k": {"1": 0.25}}, 3)
    log.close()
    assert calls[0][0] == "init" and calls[0][1]["project"] == "proj" and calls[0][1]["dir"] == str(tmp_path)
    assert calls[1] == ("log", {"train/loss": 0.5, "train/pass_at_k/1": 0.25}, 3)
    assert calls[2] == ("finish",)
    monkeypatch.delenv(WANDB_ENV)
    assert RunLog(str(tmp_path))._wandb is None  # off by default


def test_graceful_interrupt():
    with GracefulInterrupt() as it:
        assert not it.requested
        it.handle()
        assert it.requested
        with pytest.raises(KeyboardInterrupt):
            it.handle()
