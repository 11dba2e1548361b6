"""What the engines derive from the registries instead of hand-kept tables (issue 24, item 4):
an estimator declares whether it needs groups and OpenRLHF's critic-free flag, so a new one
needs no edit outside its decorated function; every component declares the metrics it
reports, so no clip fraction is logged where nothing clips. Pure registry calls: about 1 s."""
from __future__ import annotations

import argparse

import pytest
import torch

from openrlhf_div.algorithms import LossInputs, Method, get_method, list_methods, register_method
from openrlhf_div.algorithms.registry import (_REGISTRY, ESTIMATORS, POLICY_LOSSES, register_estimator,
                                              register_policy_loss)
from openrlhf_div.engines import flags as F
from openrlhf_div.engines.local.guards import check_group_size


def _mean_baseline(rewards, group_size, correct):
    r = rewards.view(-1, group_size)
    return (r - r.mean(1, keepdim=True)).view(-1)


def _raw(rewards, group_size, correct):
    return rewards.clone()


def _unregister(methods=(), estimators=(), policy_losses=()):
    for name in methods:
        _REGISTRY.pop(name, None)
    for name in estimators:
        ESTIMATORS.pop(name, None)
    for name in policy_losses:
        POLICY_LOSSES.pop(name, None)


@pytest.fixture(scope="module", autouse=True)
def _test_estimators():
    """Registered for this module only: every test process collects every file, and another
    file's test runs one step of every registered method."""
    register_estimator("test_mean_baseline")(_mean_baseline)
    register_estimator("test_raw_reward", group=False, openrlhf_estimator="reinforce_baseline")(_raw)
    register_method(Method("test_meanbase", "a new estimator, nothing else edited", estimator="test_mean_baseline"))
    register_method(Method("test_raw", "an estimator without groups", estimator="test_raw_reward"))
    yield
    _unregister(("test_meanbase", "test_raw"), ("test_mean_baseline", "test_raw_reward"))


def test_a_new_estimator_reaches_the_ray_flags_and_the_guards():
    div = argparse.Namespace(method="test_meanbase")
    derived = F.derive_upstream_flags(get_method("test_meanbase"), [], div)
    i = derived.argv.index("--algo.advantage.estimator")
    assert derived.argv[i + 1] == "group_norm"  # was a bare KeyError in a hand-kept table
    assert F.estimator_flag("test_raw_reward") == "reinforce_baseline"
    # the local group-size guard reads the declaration (it used to skip unknown estimators)
    assert "test_mean_baseline" in check_group_size(get_method("test_meanbase"), 1)
    assert check_group_size(get_method("test_raw"), 1) is None
    assert check_group_size(get_method("test_meanbase"), 2) is None
    # the built-ins keep their flags
    assert {n: F.estimator_flag(n) for n in ("grpo", "dr_grpo", "rloo", "passk", "pkpo")} == \
        {"grpo": "group_norm", "dr_grpo": "dr_grpo", "rloo": "rloo", "passk": "group_norm", "pkpo": "rloo"}
    assert all(ESTIMATORS[n].group for n in ("grpo", "dr_grpo", "rloo", "passk", "pkpo"))


def _dummy():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(2, 4, generator=g) - 0.1
    old = lp + 0.4 * torch.randn(2, 4, generator=g)
    return LossInputs(log_probs=lp, old_log_probs=old, advantages=torch.tensor([1.0, -1.0]), mask=torch.ones(2, 4),
                      correct=torch.tensor([True, False]), ref_log_probs=lp - 0.1, entropy=torch.ones(2, 4),
                      log_z=torch.zeros(2), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", [n for n in list_methods() if not n.startswith("test_")])
def test_metrics_are_what_the_components_declare(name):
    m = get_method(name)
    _, metrics = m.online_loss(_dummy())
    assert tuple(metrics) == m.metric_names()
    clips = POLICY_LOSSES[m.policy_loss].name in ("ppo_clip", "cispo", "clip_cov")
    assert ("clipfrac" in metrics) == clips, (name, m.policy_loss, list(metrics))


def test_no_clip_fraction_where_nothing_clips():
    for name in ("lad_js", "flowrl", "kl_cov"):
        assert "clipfrac" not in get_method(name).metric_names(), name
    for name in ("grpo", "dapo", "cispo", "clip_cov", "dph_js"):
        assert "clipfrac" in get_method(name).metric_names(), name


def test_an_undeclared_metric_is_an_error():
    @register_policy_loss("test_chatty", defaults={})
    def chatty(b: LossInputs):
        return torch.zeros_like(b.log_probs), {"surprise": b.log_probs}

    try:
        register_method(Method("test_chatty_m", "x", policy_loss="test_chatty"))
        with pytest.raises(ValueError, match=r"policy loss 'test_chatty' returned metrics \['surprise'\].*"
                                             r"metrics=\('surprise',\)"):
            get_method("test_chatty_m").online_loss(_dummy())
    finally:
        _unregister(("test_chatty_m",), policy_losses=("test_chatty",))


def test_openrlhf_metric_keys_are_the_declared_metrics():
    """The OpenRLHF actor's metric keys (every data-parallel rank all-reduces the same set) come
    from Method.metric_names(), not from a dummy loss run: they are the keys a real loss reports."""
    pytest.importorskip("openrlhf")
    from openrlhf_div.engines.openrlhf.loss import metric_keys

    for name in [n for n in list_methods() if not n.startswith("test_")]:
        m = get_method(name)
        _, metrics = m.online_loss(_dummy())
        assert metric_keys(m) == [f"div/{k}" for k in metrics] + ["div/loss_exp", "div/loss_pef", "div/loss"], name


def test_the_ray_driver_refuses_one_sample_per_prompt_with_a_group_estimator(monkeypatch):
    """OpenRLHF 0.11.2's own driver (train_ppo_ray) asserts n_samples_per_prompt > 1 for its estimators
    rloo, reinforce_baseline, group_norm and dr_grpo, naming its estimator; the plan refuses first, in
    one line, with the local engine's guard (check_group_size: one home) naming the method and the
    setting, and also for a group estimator whose OpenRLHF flag is none of those (OpenRLHF would run
    it, every advantage 0). The dry run: no Ray."""
    from openrlhf_div.engines.experiment import find_experiment
    from openrlhf_div.engines.openrlhf import launch as L

    for var in ("DATA_DIR", "RUN_DIR", "PRESAMPLE_DIR", "SEED", "TINY_MODEL"):
        monkeypatch.delenv(var, raising=False)
    path = find_experiment("tiny_cpu_grpo")
    want = check_group_size(get_method("grpo"), 1, key="rollout.n_samples_per_prompt")
    assert want.startswith("rollout.n_samples_per_prompt=1: method 'grpo' uses the group estimator 'grpo'")
    for one in (["openrlhf.rollout.n_samples_per_prompt=1"], ["--rollout.n_samples_per_prompt", "1"]):
        with pytest.raises(ValueError) as exc:
            L.plan(["--config", path, *one, "--dry-run"])
        assert str(exc.value) == want, one
    assert L.plan(["--config", path, "openrlhf.rollout.n_samples_per_prompt=2", "--dry-run"]).args.rollout \
        .n_samples_per_prompt == 2
    register_estimator("test_group_reinforce", openrlhf_estimator="reinforce")(_mean_baseline)
    register_method(Method("test_grp_rf", "a group estimator on OpenRLHF's plain reinforce flag",
                           estimator="test_group_reinforce"))
    try:
        with pytest.raises(ValueError, match=r"^rollout.n_samples_per_prompt=1: method 'test_grp_rf' uses the group "
                                             r"estimator 'test_group_reinforce'.* use rollout.n_samples_per_prompt >= 2"):
            # batch sizes for one sample per prompt: OpenRLHF's other checks pass, its group check does not apply
            L.plan(["--config", path, "--div.method", "test_grp_rf", "--rollout.n_samples_per_prompt", "1",
                    "--rollout.micro_batch_size", "4", "--train.batch_size", "4", "--train.micro_batch_size", "4",
                    "--dry-run"])
    finally:
        _unregister(("test_grp_rf",), ("test_group_reinforce",))
