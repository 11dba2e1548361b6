"""Adding a policy loss from outside the library (issue 11's "done when"): one decorated
function in this file and one ``register_method`` call, then two training steps in the local
engine and two real OpenRLHF actor steps (DeepSpeed on CPU), no library file edited.

The loss is "PPO without the lower clip and with a hinge on the ratio", a made-up objective:
``l = -A min(r, 1 + eps) + c relu(r - 1 - eps)``; the tests check the engines apply exactly
it (against an independent recomputation), that its own hyperparameters reach it and that a
typo in one is an error that names the valid ones.
"""
from __future__ import annotations

import pytest
import torch

from openrlhf_div.algorithms import LossInputs, Method, Needs, get_method, register_method, register_policy_loss
from openrlhf_div.algorithms._utils import zero_masked

from helpers import local_overrides, write_copy_last_data

CALLS = []


@register_policy_loss("test_hinge_ppo", defaults={"hinge_eps": 0.2, "hinge_coef": 0.5}, needs=Needs(),
                      metrics=("hinge_active",))
def hinge_ppo(b: LossInputs, hinge_eps, hinge_coef):
    r = torch.exp((b.log_probs - b.old_log_probs).clamp(-20, 20))
    CALLS.append((hinge_eps, hinge_coef))
    loss = -b.advantages * r.clamp(max=1 + hinge_eps) + hinge_coef * torch.relu(r - 1 - hinge_eps)
    return zero_masked(loss, b.mask), {"hinge_active": (r > 1 + hinge_eps).to(r.dtype)}


register_method(Method("test_hinge", "PPO without the lower clip, plus a hinge on the ratio",
                       policy_loss="test_hinge_ppo", hparams={"hinge_coef": 0.25}))


def _by_hand(b: LossInputs, eps=0.2, coef=0.25, num_tokens=None):
    m = b.mask.double()
    A = b.advantages.double()
    A = A.unsqueeze(-1) if A.dim() == 1 else A
    r = torch.exp((b.log_probs.detach().double() - b.old_log_probs.double()).clamp(-20, 20))
    per = (-A * torch.minimum(r, torch.full_like(r, 1 + eps)) + coef * (r - 1 - eps).clamp(min=0)) * m
    return per.sum() / (m.sum() if num_tokens is None else num_tokens)


def test_the_method_is_composed_from_the_new_component():
    m = get_method("test_hinge", hinge_eps=0.1)
    assert m.hparams["hinge_eps"] == 0.1 and m.hparams["hinge_coef"] == 0.25
    assert m.needs == Needs()
    with pytest.raises(ValueError, match="hinge_coef"):
        get_method("test_hinge", hinge_cof=1.0)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("test_hinge_ppo")(hinge_ppo)
    with pytest.raises(ValueError, match="test_hinge_ppo"):
        register_method(Method("x", "x", policy_loss="test_hinge_pp"))
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    b = LossInputs(lp, old, torch.tensor([1.0, -0.5, 0.0], dtype=torch.float64), torch.ones(3, 5))
    loss, metrics = m.loss(online=b)
    assert float(loss.detach()) == pytest.approx(float(_by_hand(b, eps=0.1)), rel=1e-12)
    assert list(metrics)[:2] == ["policy_loss", "hinge_active"] and "clipfrac" not in metrics  # it does not clip
    assert torch.autograd.gradcheck(lambda x: m.online_loss(LossInputs(x, old, b.advantages, b.mask))[0], (lp,))


# ----------------------------------------------------------------------------- the local engine
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_copy_last_data(tmp_path_factory.mktemp("data"))


def test_two_local_engine_steps(data_dir, tmp_path):
    from openrlhf_div.engines.local.config import load_config
    from openrlhf_div.engines.local.trainer import Trainer

    events = []
    cfg = load_config(None, local_overrides(data_dir, tmp_path / "run", "test_hinge", ["optim.steps=2"]))
    tr = Trainer(cfg, hooks=[events.append])
    before = [p.detach().clone() for p in tr.model.parameters()]
    CALLS.clear()
    tr.train()
    assert len({e["step"] for e in events}) == 2  # two optimizer steps
    assert CALLS and set(CALLS) == {(0.2, 0.25)}
    for e in events:
        b = e["online"]
        clone = LossInputs(b.log_probs.detach(), b.old_log_probs, b.advantages, b.mask)
        assert float(e["loss"]) == pytest.approx(float(_by_hand(clone, num_tokens=e["num_online_tokens"])),
                                                 rel=1e-5, abs=1e-6)
    moved = max(float((p.detach() - q).abs().max()) for p, q in zip(tr.model.parameters(), before))
    assert moved > 0


# ----------------------------------------------------------------------------- OpenRLHF's actor
import openrlhf_actor as ACTOR  # noqa: E402 (tests/openrlhf_actor.py: DeepSpeed on CPU, rollouts, steps)

world = ACTOR.world


@pytest.mark.slow
def test_two_openrlhf_actor_steps(world):
    method = get_method("test_hinge")
    mp = pytest.MonkeyPatch()
    try:
        tr = ACTOR._build_trainer(world, mp, micro=4, train_batch=4, method=method)
        for seed, rewards in ((1, [1.0, 0.0, 1.0, 0.0]), (2, [0.0, 1.0, 1.0, 0.0])):
            exp = ACTOR._rollout(tr, method, rewards, seed=seed)
            CALLS.clear()
            expected, applied, status, moved = ACTOR._step(tr, method, exp)
            assert CALLS and set(CALLS) == {(0.2, 0.25)}
            assert applied == pytest.approx(expected, rel=1e-5, abs=1e-6)
            assert abs(expected) > 1e-4 and moved > 0
            assert status["metrics"]["actor_grad_norm"] > 0
    finally:
        mp.undo()
