"""The local engine's exact speed-ups (engines/local/speed.py, issue 32): the on-policy shortcut and
length buckets change no loss and no gradient, for every registered method, and switch themselves
off where their premise fails. Nothing here is timed (the figures: benchmarks, docs/benchmarks.md).

Each comparison runs one RL step of two trainers with the same seed (same samples, same rows, same
anchors), one with the speed-up and one without, and compares the step's summed micro-batch loss
and the gradient handed to the optimizer. Cost: three one-step trainers per registered method (tiny
model, one thread).
"""
from __future__ import annotations

import types

import pytest
import torch

from openrlhf_div.algorithms import get_method, list_methods
from openrlhf_div.engines.local import speed
from openrlhf_div.engines.local.config import load_config
from openrlhf_div.engines.local.presample import presample
from openrlhf_div.engines.local.trainer import Trainer

from helpers import local_overrides, write_copy_last_data

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_copy_last_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def presample_dir(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("presample")
    cfg = load_config(None, local_overrides(data_dir, out / "run", extra=["presample.tau=1", "presample.chunk_size=20"]))
    assert presample(cfg, str(out / "ps"), progress=False)["complete"]
    return out / "ps"


def one_step(name, data_dir, presample_dir, out, extra):
    """One step of ``name``: (trainer, summed micro-batch loss, gradients at the optimizer step)."""
    extra = ["optim.steps=1", "rollout.prompts_per_step=3", "rollout.group_size=4", "optim.micro_batch_size=4",
             "rollout.max_new_tokens=5", *extra]
    if get_method(name).needs.anchor_batch:
        extra.append(f"data.presample_dir={presample_dir}")
    losses = []
    tr = Trainer(load_config(None, local_overrides(data_dir, out, name, extra)),
                 hooks=[lambda e: losses.append(e["loss"].detach().double())])
    grads = []
    step = tr.optimizer.step

    def record(*a, **k):
        grads.append([p.grad.detach().clone() if p.grad is not None else None
                      for g in tr.optimizer.param_groups for p in g["params"]])
        return step(*a, **k)

    tr.optimizer.step = record
    tr.train_step()
    assert losses and len(grads) == 1, name
    return tr, float(sum(losses)), grads[0]


def assert_same(name, a, b):
    (_, la, ga), (_, lb, gb) = a, b
    assert la == pytest.approx(lb, rel=1e-5, abs=1e-6), name
    for x, y in zip(ga, gb):
        assert (x is None) == (y is None), name
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", list_methods())
def test_shortcut_and_buckets_give_the_plain_path_loss_and_gradients(name, data_dir, presample_dir, tmp_path):
    """Three trainers: both on (the default), the shortcut off (old log-probs from their own no-grad
    forward, bucketed), both off (today's path before issue 32)."""
    both = one_step(name, data_dir, presample_dir, tmp_path / "both", [])
    no_shortcut = one_step(name, data_dir, presample_dir, tmp_path / "b", ["rollout.on_policy_shortcut=false"])
    plain = one_step(name, data_dir, presample_dir, tmp_path / "plain", ["rollout.on_policy_shortcut=false",
                                                                         "optim.length_buckets=false"])
    m = get_method(name)
    # each switches itself off where its premise fails (the rollout side reads old log-probs; the loss
    # depends on which rows share a micro-batch), and is on otherwise
    assert both[0].on_policy_shortcut == (speed.rollout_reads_old_log_probs(m) is None), name
    assert both[0].length_buckets == (speed.grouping_dependence(m) is None), name
    assert not plain[0].on_policy_shortcut and not plain[0].length_buckets
    assert_same(f"{name} (shortcut)", both, no_shortcut)
    assert_same(f"{name} (buckets)", no_shortcut, plain)


def test_length_buckets_cut_padding_and_the_share_is_reported(data_dir, presample_dir, tmp_path):
    longer = ["rollout.on_policy_shortcut=false", "rollout.max_new_tokens=12"]  # responses of varied length
    tr, _, _ = one_step("grpo", data_dir, presample_dir, tmp_path / "on", longer)
    stats_on = tr.train_step()
    tr2, _, _ = one_step("grpo", data_dir, presample_dir, tmp_path / "off", longer + ["optim.length_buckets=false"])
    stats_off = tr2.train_step()
    for phase in ("logprob", "train"):
        assert 0 <= stats_on[f"padded_share_{phase}"] < 1
        assert stats_on[f"padded_share_{phase}"] <= stats_off[f"padded_share_{phase}"], phase
    assert stats_on["padded_share_logprob"] < stats_off["padded_share_logprob"]  # unbucketed: the full batch width


def test_the_shortcut_switches_itself_off():
    def cfg(**kw):
        r = dict(on_policy_shortcut=True, recompute_old_log_probs=True)
        o = dict(ppo_epochs=1, mini_batches=1)
        for k, v in kw.items():
            (r if k in r else o)[k] = v
        return types.SimpleNamespace(rollout=types.SimpleNamespace(**r), optim=types.SimpleNamespace(**o))

    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    grpo = get_method("grpo")
    assert speed.shortcut_decision(cfg(), grpo, plain) == (True, "one optimizer pass over one mini-batch")
    assert "ppo_epochs=2" in speed.shortcut_decision(cfg(ppo_epochs=2), grpo, plain)[1]
    assert not speed.shortcut_decision(cfg(ppo_epochs=2), grpo, plain)[0]
    assert not speed.shortcut_decision(cfg(mini_batches=2), grpo, plain)[0]
    assert not speed.shortcut_decision(cfg(recompute_old_log_probs=False), grpo, plain)[0]
    assert not speed.shortcut_decision(cfg(on_policy_shortcut=False), grpo, plain)[0]
    on, why = speed.shortcut_decision(cfg(), grpo, torch.nn.Sequential(torch.nn.Dropout(0.1)))
    assert not on and "dropout p=0.1" in why
    shaped = [m for m in list_methods() if get_method(m).reward_shaping]
    ds = [m for m in list_methods() if "ds" in get_method(m).adv_reshaping]
    assert shaped and ds  # the registry has both kinds, so the parametrized test above covers the off path
    for m in shaped + ds:
        on, why = speed.shortcut_decision(cfg(), get_method(m), plain)
        assert not on and "reads them at rollout time" in why, m


def test_bucketing_stays_off_where_the_layout_decides():
    stats = [m for m in list_methods() if get_method(m).policy_loss in ("clip_cov", "kl_cov")]
    assert stats
    for m in stats:
        assert "takes statistics over a micro-batch's tokens" in speed.grouping_dependence(get_method(m)), m
    authors = get_method("dph_js", aggregation="micro-batch-token-mean")  # the authors' layout, an override
    assert "micro-batch-token-mean" in speed.grouping_dependence(authors)
    assert speed.grouping_dependence(get_method("grpo")) is None
    cfg = types.SimpleNamespace(optim=types.SimpleNamespace(length_buckets=True))
    assert speed.bucket_decision(cfg, authors)[0] is False and speed.bucket_decision(cfg, get_method("grpo"))[0]


def test_trim_is_exact():
    from openrlhf_div.engines.local.generation import pack_sequences, sequence_log_probs
    from openrlhf_div.engines.local.tiny import build_tiny_model
    from helpers import VOCAB

    model, tok = build_tiny_model(VOCAB, seed=0)
    prompts, responses = [[5, 6, 7, 8, 9], [5, 6], [7, 8]], [[4, 5, 6, 7], [4], [9, 9]]
    ids, attn, rm = pack_sequences(prompts, responses, tok.pad_token_id)
    sub = torch.tensor([1, 2])  # short rows: the batch's widest prompt and response are not theirs
    t_ids, t_attn, t_rm = speed.trim(ids[sub], attn[sub], rm[sub])
    assert t_ids.shape == (2, 2 + 2) and t_rm.shape == (2, 2)
    with torch.no_grad():
        full = sequence_log_probs(model, ids[sub], attn[sub], rm[sub])
        cut = sequence_log_probs(model, t_ids, t_attn, t_rm)
    torch.testing.assert_close(full[:, :2], cut, rtol=0, atol=1e-6)
