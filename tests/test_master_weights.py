"""bfloat16 training with float32 master weights (``model.master_weights``, engines/local/precision.py)
on the tiny model: same update as float32 training within bfloat16 tolerance, master copies
stay float32, small updates are kept (plain bfloat16 rounds them away), the float32 copies
round-trip through a checkpoint, and checkpoints are saved in the training dtype (bfloat16)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from openrlhf_div.engines.local.config import ConfigError, load_config
from openrlhf_div.engines.local.precision import MasterWeights
from openrlhf_div.engines.local.tiny import build_tiny_model
from openrlhf_div.engines.local.trainer import Trainer
from openrlhf_div.io import atomic_write_jsonl
from openrlhf_div.tasks import RewardResult, Task, register_task

VOCAB = "abcdef="


class ShareOfA(Task):
    """Reward: the share of 'a' in the response (varies within almost every group)."""

    name = "test_share_of_a"

    def prompt(self, example):
        return example["prompt"]

    def score(self, response, label):
        r = response.count("a") / max(1, len(response))
        return RewardResult(r, r > 0.5)


register_task("test_share_of_a", lambda **kw: ShareOfA())


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("mw") / "train.jsonl"
    atomic_write_jsonl(str(p), [{"prompt": s + "=", "label": "a", "id": f"e{i}"}
                                for i, s in enumerate(["ab", "cd", "ef", "abc", "fed", "ca", "bb", "dd"])])
    return p


def _cfg(train_file, out, extra=()):
    return load_config(None, [
        "task=test_share_of_a", f"output_dir={out}", f"model.tiny_vocab={VOCAB}", f"data.train={train_file}",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "optim.steps=1",
        "optim.learning_rate=1e-3", "eval.at_start=false", "logging.tensorboard=false", "logging.progress=false",
        "checkpoint.every=0", "num_threads=1", "method.name=grpo", *extra])


def _loss(model, ids):
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_master_weights_sgd_step_matches_float32_within_bfloat16_tolerance():
    ref, _ = build_tiny_model(VOCAB, seed=0)
    model, _ = build_tiny_model(VOCAB, seed=0)
    ids = torch.randint(0, len(VOCAB) + 2, (4, 12), generator=torch.Generator().manual_seed(0))
    mw = MasterWeights(model.parameters())
    model.to(torch.bfloat16)
    w0 = [p.detach().clone() for p in ref.parameters()]
    assert all(torch.equal(m, w) for m, w in zip(mw.master, w0))  # exact float32 copies
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD([mw.master_of(p) for p in model.parameters()], lr=0.1)
    _loss(ref, ids).backward()
    opt_ref.step()
    _loss(model, ids).backward()
    mw.grads_to_master()
    assert all(p.grad is None for p in model.parameters()) and all(m.grad.dtype == torch.float32 for m in mw.master)
    opt.step()
    mw.master_to_model()
    for m, p, r, w in zip(mw.master, model.parameters(), ref.parameters(), w0):
        assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
        d_ref, d = (r - w).detach(), m - w
        assert (d - d_ref).norm() <= 0.05 * d_ref.norm() + 1e-6  # bfloat16 forward/backward error
        assert torch.equal(p.detach(), m.to(torch.bfloat16))  # the model holds the rounded master


def test_small_updates_survive_with_master_weights_and_are_lost_without(train_file, tmp_path):
    """AdamW at lr 1e-6: the first update of every weight is ~1e-6, below half a bfloat16 ulp
    of the tiny model's weights. Plain bfloat16 training leaves (almost) every weight unchanged;
    with master weights the float32 copies move by ~lr, as in float32 training."""
    lr = ["optim.learning_rate=1e-6"]
    runs = {}
    for name, extra in {"fp32": [], "bf16": ["model.dtype=bfloat16"],
                        "bf16_master": ["model.dtype=bfloat16", "model.master_weights=true"]}.items():
        tr = Trainer(_cfg(train_file, tmp_path / name, lr + extra))
        before = [p.detach().float().clone() for p in tr._checked_params()]
        tr.train_step()
        after = [p.detach().float() for p in tr._checked_params()]
        moved = sum(int((a != b).sum()) for a, b in zip(after, before)) / sum(b.numel() for b in before)
        runs[name] = (tr, moved)
    assert runs["fp32"][1] > 0.5
    assert runs["bf16"][1] < 0.05  # the bug master weights fix: updates rounded away
    tr, moved = runs["bf16_master"]
    assert moved > 0.5
    assert all(p.dtype == torch.float32 for p in tr._checked_params())  # the optimizer's params: fp32 masters
    assert all(p.dtype == torch.bfloat16 for p in tr.model.parameters())
    st = tr.optimizer.state[tr._checked_params()[0]]
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32


def test_master_weights_round_trip_through_a_checkpoint_and_save_in_bfloat16(train_file, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    extra = ["model.dtype=bfloat16", "model.master_weights=true", "optim.steps=2"]
    full = Trainer(_cfg(train_file, tmp_path / "full", extra))
    full.train()
    part = Trainer(_cfg(train_file, tmp_path / "part", extra + ["checkpoint.every=1"]))
    part.train(steps=1)
    ckpt = part.latest_checkpoint()
    st = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    saved = st["master_weights"]["master"]
    assert all(t.dtype == torch.float32 for t in saved)
    assert all(torch.equal(a, b) for a, b in zip(saved, part.master.master))
    with safe_open(os.path.join(ckpt, "model", "model.safetensors"), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16  # the training dtype
    resumed = Trainer(_cfg(train_file, tmp_path / "part", extra), resume_dir=str(tmp_path / "part"))
    # the exact float32 values come back, not the bfloat16-rounded model's
    assert all(torch.equal(a, b) for a, b in zip(resumed.master.master, saved))
    res = resumed.train()
    for a, b in zip(resumed.master.master, full.master.master):
        assert torch.equal(a, b)  # resumed == uninterrupted, bit for bit
    final = os.path.join(res["run_dir"], "final_model")
    model = AutoModelForCausalLM.from_pretrained(final, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16
    with open(os.path.join(res["run_dir"], "metrics.jsonl")) as f:
        assert [json.loads(x)["step"] for x in f] == [1, 2]


def test_master_weights_need_bfloat16(train_file, tmp_path):
    with pytest.raises(ConfigError, match="model.master_weights needs model.dtype=bfloat16"):
        _cfg(train_file, tmp_path / "x", ["model.master_weights=true", "model.dtype=float32"])
