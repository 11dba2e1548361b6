"""The local engine's sampler seam (engines/local/sampler_registry.py): one protocol, one registry,
and every site that samples - the trainer (rollouts, evaluation, weight sync, sleep, close),
pre-sampling, ``openrlhf-div eval --engine local`` and the demo's evaluation - asks it.

A recording backend is registered under a new name (``rec``): it wraps the real hf sampler, so
the results are those of the hf path, and counts every protocol call. A site that bypassed the
registry (called :func:`.generation.generate` itself, or branched on a backend name) would leave
the counters at zero. Cost: ~5 s (tiny model, two RL steps, one small pre-sampling).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from openrlhf_div.engines.local import sampler_registry as reg
from openrlhf_div.engines.local.config import ConfigError, load_config
from openrlhf_div.engines.local.presample import presample
from openrlhf_div.engines.local.trainer import Trainer

from helpers import local_overrides, write_copy_last_data

torch.set_num_threads(1)


class Recorder(reg.HFSampler):
    """The hf sampler, counting the protocol calls of every instance in ``calls``."""

    name = "rec"
    calls = {"generate": 0, "sync": 0, "sleep": 0, "close": 0, "built": 0}

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        Recorder.calls["built"] += 1

    def generate(self, prompts, **kw):
        Recorder.calls["generate"] += 1
        return super().generate(prompts, **kw)

    def sync(self, model):
        Recorder.calls["sync"] += 1
        super().sync(model)

    def sleep(self):
        Recorder.calls["sleep"] += 1

    def close(self):
        Recorder.calls["close"] += 1


@pytest.fixture
def rec():
    for k in Recorder.calls:
        Recorder.calls[k] = 0
    reg.register_sampler("rec", lambda model, tok, rollout_cfg=None, *, device=None, seed=0: Recorder(model, tok),
                         description="a recording hf sampler")
    yield Recorder.calls
    reg._REGISTRY.pop("rec", None)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_copy_last_data(tmp_path_factory.mktemp("data"))


def test_unknown_backend_is_one_line_naming_the_choices():
    with pytest.raises(ValueError) as e:
        reg.get_spec("sglang")
    msg = str(e.value)
    assert "\n" not in msg and "'sglang'" in msg and "auto, hf, vllm" in msg
    with pytest.raises(ValueError, match=r"unknown sampler backend 'trt'; choose one of auto, hf, vllm"):
        reg.resolve_backend("trt", None, "cpu")
    with pytest.raises(ValueError, match=r"unknown sampler backend 'trt'"):
        reg.open_sampler("trt", None, None, None, device="cpu", seed=0)
    with pytest.raises(ConfigError, match=r"rollout.backend must be one of auto, hf, vllm, got 'trt'"):
        load_config(None, ["task=toy_copy", "rollout.backend=trt"])
    assert reg.sampler_names() == ("hf", "vllm") and reg.backend_choices() == ("auto", "hf", "vllm")
    with pytest.raises(ValueError, match="cannot be named 'auto'"):
        reg.register_sampler("auto", lambda *a, **k: None)


def test_registered_backends_follow_the_protocol_and_a_new_one_is_accepted(rec):
    from openrlhf_div.engines.local.vllm_sampler import VLLMSampler

    assert isinstance(reg.HFSampler(None, None), reg.Sampler)
    for meth in ("generate", "sync", "sleep", "close"):
        assert callable(getattr(VLLMSampler, meth)), meth
    assert VLLMSampler.name == "vllm" and reg.HFSampler.name == "hf"
    # the config's choices come from the registry
    assert load_config(None, ["task=toy_copy", "rollout.backend=rec"]).rollout.backend == "rec"
    assert "rec" in reg.backend_choices()


def test_auto_picks_in_order_and_an_explicit_backend_that_cannot_run_is_refused(monkeypatch):
    lines = []
    monkeypatch.setitem(reg._REGISTRY, "vllm", reg.SamplerSpec("vllm", None, lambda m, d: "not here (test)", "v", "vLLM"))
    assert reg.resolve_backend("auto", None, "cpu", log=lines.append) == "hf"
    assert lines == ["[openrlhf-div] rollout.backend=auto: sampling with hf (the local KV-cache sampler): "
                     "not here (test)"]
    with pytest.raises(reg.SamplerUnavailable, match=r"rollout.backend=vllm but vLLM cannot sample here: "
                                                     r"not here \(test\). Use rollout.backend=auto or hf"):
        reg.resolve_backend("vllm", None, "cpu")

    def boom(*a, **k):
        raise ValueError("bfloat16 is not supported on this CPU")

    monkeypatch.setitem(reg._REGISTRY, "vllm", reg.SamplerSpec("vllm", boom, lambda m, d: None, "v"))
    lines.clear()
    s = reg.open_sampler("auto", None, None, None, device="cpu", seed=0, log=lines.append)
    assert s.name == "hf" and len(lines) == 1 and "did not start (ValueError: bfloat16 is not supported" in lines[0]
    with pytest.raises(ValueError, match="bfloat16"):  # explicit: no fallback
        reg.open_sampler("vllm", None, None, None, device="cpu", seed=0)


def test_the_trainer_samples_evaluates_syncs_and_closes_through_the_registry(rec, data_dir, tmp_path):
    cfg = load_config(None, local_overrides(data_dir, tmp_path / "run", extra=[
        "rollout.backend=rec", f"data.eval={data_dir / 'eval.jsonl'}", "eval.n_samples=2", "eval.k=[1]"]))
    tr = Trainer(cfg)
    assert rec["built"] == 1 and tr.backend == "rec"
    tr.train_step()
    assert rec["generate"] >= 1 and rec["sleep"] == 1 and rec["sync"] == 1  # weights changed -> one sync
    n_gen = rec["generate"]
    tr.evaluate()
    assert rec["generate"] > n_gen  # evaluation samples with the trainer's sampler
    tr.close_sampler()
    assert rec["close"] == 1
    info_backend = tr.backend
    assert info_backend == "rec"


def test_the_trainer_with_hf_is_unchanged_by_the_seam(data_dir, tmp_path):
    """The hf backend through the registry draws the same samples as generation.generate on the
    trainer's generator (the path before the seam)."""
    from openrlhf_div.engines.local.generation import generate

    cfg = load_config(None, local_overrides(data_dir, tmp_path / "run", extra=["rollout.backend=hf"]))
    tr = Trainer(cfg)
    assert isinstance(tr.sampler, reg.HFSampler)
    prompts = [tr.prompt_ids(ex) for ex in tr.train_examples[:3]]
    a = tr.sample(prompts, n_samples=2, max_new_tokens=4, temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = generate(tr.model, tr.tokenizer, prompts, n_samples=2, max_new_tokens=4, temperature=1.0,
                 generator=torch.Generator().manual_seed(1))
    assert a.response_ids == b.response_ids and torch.equal(a.log_probs, b.log_probs)


def test_presample_samples_through_the_registry_and_records_the_backend(rec, data_dir, tmp_path):
    cfg = load_config(None, local_overrides(data_dir, tmp_path / "run", extra=[
        "rollout.backend=rec", "presample.tau=1", "presample.chunk_size=20", "presample.n_pre=2"]))
    s = presample(cfg, str(tmp_path / "ps"), progress=False)
    assert s["complete"] and rec["built"] == 1 and rec["generate"] == 2 and rec["close"] == 1
    settings = json.load(open(os.path.join(tmp_path, "ps", "summary.json")))
    assert json.dumps(settings).count('"sampler": "rec"') >= 1


def test_eval_and_demo_evaluation_sample_through_the_registry(rec, monkeypatch, tmp_path):
    from openrlhf_div.demo.evaluate import evaluate_model
    from openrlhf_div.engines.local import samplers
    from openrlhf_div.engines.local.models import save_model
    from openrlhf_div.engines.local.tiny import build_tiny_model

    from helpers import VOCAB

    # the entries are looked up at call time: pointing "hf" at the recorder shows each site asks the registry
    monkeypatch.setitem(reg._REGISTRY, "hf", reg._REGISTRY["rec"])
    model, tok = build_tiny_model(VOCAB, seed=0)
    save_model(model, tok, str(tmp_path / "m"))
    fn, _, engine = samplers.make_generate_fn(str(tmp_path / "m"), engine="local", device="cpu", seed=0)
    assert engine == "local" and rec["built"] == 1
    out = fn(["ab=", "a="], n=2, max_new_tokens=3)
    assert len(out) == 2 and len(out[0]) == 2 and rec["generate"] == 1
    evaluate_model(model, tok, [{"prompt": "ab=", "label": "b", "id": "x"}], task="test_copy_last", n_samples=2,
                   max_new_tokens=3)
    assert rec["built"] == 2 and rec["generate"] == 2
