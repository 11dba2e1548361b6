"""One real OpenRLHF actor training step per method family, on CPU.

DeepSpeed's CPU accelerator, ZeRO-0, world size 1, gloo; a 2-layer Qwen2 (hidden 64) built
from a config; OpenRLHF's ``Actor`` + ``DeepspeedStrategy.prepare`` + our
``DivActorPPOTrainer`` (a subclass of OpenRLHF's ``ActorPPOTrainer``). For PPO-clip (grpo),
the DPH anchor (dph_f), DS reshaping (ds_grpo) and LAD (lad_js):

* the loss handed to DeepSpeed's backward equals the registry's ``Method.loss`` computed on
  log-probs from an independent plain forward of the same weights;
* a micro-batch of anchor rows contributes exactly ``eta * L_pef``;
* with gradient accumulation (gas 2) and anchors mixed in, OpenRLHF's own ``ppo_train``
  loop + our split normaliser give, per optimizer step, ``L_exp + eta * L_pef`` with each part
  a token mean over the step's own tokens.

Two CPU-only adjustments, both test-side (see docs/scaling.md "CPU checks"):
DeepSpeed's shared-memory collective op and FusedAdam are C++ extensions JIT-compiled on first
use (minutes on a small CPU box), so the test disables the former (world size 1 needs no
collective) and asks DeepSpeed for ``torch_adam``; and OpenRLHF's ``ActorPPOTrainer``
constructor / ``ppo_train`` call ``torch.cuda.synchronize`` / ``torch.cuda.current_device``
unconditionally, so those two are pointed at the CPU while the trainer is built and trained.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

from openrlhf_actor import (  # noqa: E402,F401 (fixtures and helpers: tests/openrlhf_actor.py)
    NS, V, _free_port, _tiny_model_dir, _args, _Env,
    world, _build_trainer, trainer, _plain_log_probs, _rollout, _anchor_rows,
    _plain_log_z, _registry_loss, _norm_info, _params, _step,
)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name,rewards", [
    ("grpo", [1.0, 0.0, 1.0, 0.0]),       # PPO-clip
    ("ds_grpo", [1.0, 0.0, 0.0, 1.0]),    # Differential Smoothing reshaping
    ("lad_js", [0.0, 1.0, 1.0, 0.0]),     # LAD
    ("rkl", [1.0, 1.0, 0.0, 0.0]),        # PPO-clip + k3 KL to the shipped reference log-probs
])
def test_online_step_applies_registry_loss(trainer, name, rewards):
    from openrlhf_div.algorithms import get_method

    method = get_method(name)
    exp = _rollout(trainer, method, rewards, seed=len(name))
    expected, applied, status, moved = _step(trainer, method, exp)
    assert applied == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert abs(expected) > 1e-4  # a real loss, not a trivially zero one
    assert moved > 0, "DeepSpeed's optimizer step did not change the weights"
    assert status["metrics"]["actor_grad_norm"] > 0


def test_step_logs_the_policy_entropy(trainer):
    """``div/entropy`` (the Ray progress line's entropy, issue 30) is logged for a method that does not
    train on it: the full-vocabulary entropy of softmax(logits / T) over the online tokens, equal to
    a plain HF forward's of the same weights."""
    from openrlhf_div.algorithms import get_method

    method = get_method("grpo")
    assert not method.needs.entropy
    exp = _rollout(trainer, method, [1.0, 0.0, 1.0, 0.0], seed=5)
    model = trainer.actor.model.module
    pos = (exp.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=exp.sequences, attention_mask=exp.attention_mask, position_ids=pos).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / float(getattr(trainer.actor, "temperature", 1.0)), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)[:, -exp.action_mask.shape[1]:]
    m = exp.action_mask.float()
    expected = float((ent * m).sum() / m.sum())
    _, _, status, _ = _step(trainer, method, exp)
    assert float(status["metrics"]["div/entropy"]) == pytest.approx(expected, rel=1e-4)
    assert 0.5 < expected < float(torch.log(torch.tensor(float(logits.shape[-1]))))  # a real entropy


def test_flowrl_step_trains_the_log_z_head(trainer):
    """FlowRL: seq-mean-token-mean through OpenRLHF's per-sample aggregate_loss, log Z from the
    head on the pooled prompt states, and the head's own optimizer steps with DeepSpeed's."""
    from openrlhf_div.algorithms import get_method

    method = get_method("flowrl")
    exp = _rollout(trainer, method, [1.0, 0.0, 0.0, 1.0], seed=21)
    trainer.div_method = method
    trainer._ensure_log_z_head()
    head_before = torch.cat([p.detach().reshape(-1).clone() for p in trainer.log_z_head.parameters()])
    expected, applied, _, moved = _step(trainer, method, exp)
    assert applied == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert expected > 1e-3 and moved > 0
    head_after = torch.cat([p.detach().reshape(-1) for p in trainer.log_z_head.parameters()])
    assert (head_after - head_before).abs().max() > 0, "the log Z head was not trained"
    assert all(p.grad is None for p in trainer.log_z_head.parameters())  # stepped and zeroed


def test_ds_reshaping_changes_the_loss(trainer):
    """The DS path is really taken: same rollout, grpo vs ds_grpo differ by the reshaping."""
    from openrlhf_div.algorithms import get_method

    ds = get_method("ds_grpo", gamma_p=0.5, gamma_n=0.5)
    exp = _rollout(trainer, ds, [1.0, 0.0, 0.0, 1.0], seed=7)
    trainer.div_method = ds
    l_ds = _registry_loss(trainer, ds, exp)
    grpo_exp = _rollout(trainer, get_method("grpo", eps_high=0.25), [1.0, 0.0, 0.0, 1.0], seed=7)
    l_grpo = _registry_loss(trainer, get_method("grpo", eps_high=0.25), grpo_exp)
    assert abs(l_ds - l_grpo) > 1e-3


def test_anchor_only_micro_batch_contributes_eta_times_l_pef(trainer):
    from openrlhf_div.algorithms import dph_anchor_loss, get_method

    method = get_method("dph_f", anchor_eta=0.5)
    exp = _anchor_rows(trainer, n=2)
    # independent L_pef: the public functional API, token mean over the anchor tokens
    A = exp.action_mask.shape[1]
    lp = _plain_log_probs(trainer, exp.sequences, exp.attention_mask, A)
    m = exp.action_mask.float()
    l_pef = float((dph_anchor_loss(lp, exp.base_action_log_probs, m, "forward_kl") * m).sum() / m.sum())
    expected, applied, status, moved = _step(trainer, method, exp)
    assert applied == pytest.approx(0.5 * l_pef, rel=1e-5, abs=1e-7)
    assert expected == pytest.approx(0.5 * l_pef, rel=1e-5, abs=1e-7)
    assert l_pef > 1e-4 and moved > 0
    assert status["metrics"]["div/loss_exp"].item() == 0.0


def test_mixed_micro_batch_is_l_exp_plus_eta_l_pef(trainer):
    from openrlhf_div.algorithms import get_method
    from openrlhf_div.engines.openrlhf.anchors import append_rows

    method = get_method("dph_f")  # eta 0.01
    online = _rollout(trainer, method, [1.0, 0.0, 1.0, 0.0], seed=3)
    exp = append_rows(online, _anchor_rows(trainer, n=2, seed=4), pad_token_id=0)
    trainer.div_method = method
    info, counts = _norm_info(exp)
    only_exp = _registry_loss(trainer, method, online, counts)
    expected, applied, _, _ = _step(trainer, method, exp)
    assert applied == pytest.approx(expected, rel=1e-5, abs=1e-7)
    l_pef = (expected - only_exp) / method.anchor_weight
    assert l_pef > 0  # the anchor part is present and weighted by eta


def _ppo_train_gas2(world, method, seeds):
    """OpenRLHF's ppo_train over 4 rollout rows + 4 anchor rows (micro 2, train batch 4: gas 2);
    per micro-batch ``(experience, plain log-probs, loss_batch_info, applied loss)``."""
    from openrlhf_div.engines.openrlhf.anchors import append_rows

    mp = pytest.MonkeyPatch()
    try:
        tr = _build_trainer(world, mp, micro=2, train_batch=4, method=method)
        exp = append_rows(_rollout(tr, method, [1.0, 0.0, 1.0, 1.0], seed=seeds[0], resp_lens=(4, 2, 5, 3)),
                          _anchor_rows(tr, n=4, seed=seeds[1]), pad_token_id=0)
        tr.replay_buffer.append(exp)
        assert len(tr.replay_buffer) == 8
        seen = []
        real_step = type(tr).training_step

        def spy(self, experience, kl_ctl, step, loss_batch_info=None):
            lp = _plain_log_probs(self, experience.sequences, experience.attention_mask,
                                  experience.action_mask.shape[1])
            out = real_step(self, experience, kl_ctl, step, loss_batch_info)
            seen.append((experience, lp, loss_batch_info, float(self.last_loss)))
            return out

        mp.setattr(type(tr), "training_step", spy)
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")  # OpenRLHF moves batches to "cuda"
        torch.manual_seed(seeds[0])  # the replay buffer's shuffle draws from the global generator
        tr.ppo_train(0.0)
    finally:
        mp.undo()
    return seen


def test_ppo_train_gas2_normalises_each_part_over_its_own_tokens(world):
    """OpenRLHF's ppo_train loop (DataLoader, shuffling, gas windows, DeepSpeed accumulation)
    with our split normaliser: per optimizer step, sum of applied micro-batch losses / gas ==
    Method.loss on the step's rows with the step's online and anchor token counts."""
    from openrlhf_div.algorithms import get_method
    from openrlhf_div.engines.openrlhf.loss import ANCHOR_NORM_KEY
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch

    method = get_method("dph_js", anchor_eta=0.3)
    seen = _ppo_train_gas2(world, method, seeds=(11, 12))
    assert len(seen) == 4  # 8 rows / micro 2, two optimizer steps of gas 2
    for w in (seen[:2], seen[2:]):
        items = [split for e, *_ in w for split in _split(e)]
        step = make_experience_batch(items)
        a = _flag(step)
        m = step.action_mask.float()
        n_on, n_an = float(m[~a].sum()), float(m[a].sum())
        for _, _, info, _ in w:  # the normaliser each micro-batch got: the step's totals / gas
            assert float(info["batch_num_tokens"]) == pytest.approx(n_on / 2)
            assert float(info[ANCHOR_NORM_KEY]["batch_num_tokens"]) == pytest.approx(n_an / 2)
        applied = sum(loss for *_, loss in w) / 2  # DeepSpeed scales each backward by 1/gas
        expected = _window_registry_loss(method, w, n_on, n_an)
        assert applied == pytest.approx(expected, rel=1e-5, abs=1e-7)


def _flag(exp):
    from openrlhf_div.engines.contract import row_values

    return row_values(exp.info, "div_anchor", exp.action_mask.shape[0]) > 0.5


def _split(exp):
    from openrlhf.trainer.ppo_utils.experience import split_experience_batch

    return split_experience_batch(exp)


def _window_registry_loss(method, window, n_on, n_an):
    from openrlhf_div.algorithms import AnchorInputs, LossInputs

    total = 0.0
    for exp, lp, _, _ in window:
        a = _flag(exp)
        m = exp.action_mask.float()
        online = anchor = None
        if (~a).any():
            online = LossInputs(log_probs=lp[~a], old_log_probs=exp.action_log_probs[~a].float(),
                                advantages=exp.advantages[~a].float(), mask=m[~a])
        if a.any():
            anchor = AnchorInputs(log_probs=lp[a], ref_log_probs=exp.base_action_log_probs[a].float(), mask=m[a])
        loss, _ = method.loss(online=online, anchor=anchor, num_online_tokens=n_on, num_anchor_tokens=n_an)
        total += float(loss)
    return total


def test_ppo_train_authors_layout_steps_and_micro_batch_losses(world):
    """The DPH-RL authors' layout through OpenRLHF's own ppo_train and a real DeepSpeed engine
    (micro 2, train batch 4: gas 2; 4 rollout rows + 2 anchor rows, layout.step_layout authors): two
    optimiser steps -- the rollout rows, then the anchors alone in a step of ONE micro-batch,
    whose end the layout sets as DeepSpeed's accumulation boundary -- and each micro-batch's
    applied loss is gas x (1 / (4 // 2)) x its own token-mean (x eta for the anchor one), written
    out here from the per-token losses, not through Method.loss."""
    from openrlhf_div.algorithms import get_method
    from openrlhf_div.algorithms.losses import dph_anchor_loss, ppo_clip_loss
    from openrlhf_div.engines.openrlhf.anchors import append_rows

    eta = 0.3
    method = get_method("dph_f", anchor_eta=eta, anchor_weighting="microbatch_share",
                        aggregation="micro-batch-token-mean", micro_batch_seqs=2)
    h = method.hparams
    mp = pytest.MonkeyPatch()
    try:
        tr = _build_trainer(world, mp, micro=2, train_batch=4, method=method, layout={"step_layout": "authors"})
        exp = append_rows(_rollout(tr, method, [1.0, 0.0, 1.0, 1.0], seed=31, resp_lens=(4, 2, 5, 3)),
                          _anchor_rows(tr, n=2, seed=32), pad_token_id=0)
        tr.replay_buffer.append(exp)
        seen = []
        real_step = type(tr).training_step
        engine = tr.actor.model

        def spy(self, experience, kl_ctl, step, loss_batch_info=None):
            lp = _plain_log_probs(self, experience.sequences, experience.attention_mask,
                                  experience.action_mask.shape[1])
            before = engine.global_steps
            out = real_step(self, experience, kl_ctl, step, loss_batch_info)
            seen.append((experience, lp, float(self.last_loss), engine.global_steps - before))
            return out

        mp.setattr(type(tr), "training_step", spy)
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        tr.ppo_train(0.0)
    finally:
        mp.undo()
    assert [int(_flag(e).all()) for e, *_ in seen] == [0, 0, 1]  # rollouts, rollouts | anchors
    assert [int(_flag(e).any()) for e, *_ in seen] == [0, 0, 1]  # never mixed
    assert [n for *_, n in seen] == [0, 1, 1]  # optimizer steps after micro-batches 2 and 3
    for e, lp, applied, _ in seen:
        m = e.action_mask.float()
        if _flag(e).any():
            per_tok = dph_anchor_loss(lp, e.base_action_log_probs.float(), m, "forward_kl")
            weight = eta
        else:
            per_tok = ppo_clip_loss(lp, e.action_log_probs.float(), e.advantages.float(), m, h["eps_low"],
                                    h["eps_high"], h["dual_clip"])
            weight = 1.0
        expected = 2 * 0.5 * weight * float((per_tok * m).sum() / m.sum())
        assert applied == pytest.approx(expected, rel=1e-5, abs=1e-7)
