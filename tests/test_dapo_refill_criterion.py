"""One DAPO refill criterion in both engines (issue 9): a group is kept iff its correctness is
mixed (0 < #correct < G), on the task rewards before overlong shaping -- what OpenRLHF's
generator-level filter does with the reward files' ``scores`` (``--algo.dynamic_filtering_range 0 1``).

Before: the local engine (and the OpenRLHF experience maker's mask) looked at the *shaped*
rewards, so an all-correct group with one response in the overlong zone was kept locally, a
mixed group that shaping made all-equal was dropped, and Countdown's 0.1 format reward kept
all-wrong groups.
"""
import torch

from openrlhf_div.algorithms import get_method


def shape_and_keep(method, rewards, old_log_probs, mask, group_size, lengths):
    """What the local engine does per generation round (engines/local/trainer.py calls
    ``method.rollout``, the one rollout pipeline): shaped rewards and kept groups."""
    ro = method.rollout(rewards, group_size, old_log_probs=old_log_probs, mask=mask, lengths=lengths)
    return ro.rewards, ro.keep

G = 4


def _rollout_advantages():
    from openrlhf_div.engines.openrlhf.advantages import rollout_advantages

    return rollout_advantages


def _cases():
    dapo = get_method("dapo", overlong_max_len=20, overlong_cache_len=8)
    # group 0: all correct, one response in the overlong zone (shaped rewards differ)
    # group 1: mixed correctness (kept)
    # group 2: all wrong
    rewards = torch.tensor([1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0], dtype=torch.float32)
    lengths = torch.tensor([5, 5, 5, 18, 5, 5, 5, 5, 5, 5, 5, 5])
    return dapo, rewards, lengths


def test_local_engine_keeps_mixed_correctness_only():
    dapo, rewards, lengths = _cases()
    mask = torch.ones(12, 20)
    shaped, keep = shape_and_keep(dapo, rewards, torch.zeros(12, 20), mask, G, lengths)
    assert shaped[3] < 1.0  # the overlong shaping did change a reward of group 0
    assert keep.tolist() == [False, True, False]


def test_openrlhf_experience_maker_mask_uses_the_same_criterion():
    dapo, rewards, lengths = _cases()
    mask = torch.ones(12, 20)
    _, keep_local = shape_and_keep(dapo, rewards, torch.zeros(12, 20), mask, G, lengths)
    out = _rollout_advantages()(dapo, rewards, torch.zeros(12, 20), mask, G, lengths)
    assert out.keep.reshape(-1, G)[:, 0].tolist() == keep_local.tolist()


def test_countdown_format_reward_does_not_keep_an_all_wrong_group():
    dapo = get_method("dapo", overlong_max_len=None)
    rewards = torch.tensor([0.1, 0.0, 0.1, 0.1, 1.0, 0.1, 0.0, 0.0])
    _, keep = shape_and_keep(dapo, rewards, torch.zeros(8, 4), torch.ones(8, 4), G, None)
    assert keep.tolist() == [False, True]
