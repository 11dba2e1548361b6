"""The OpenRLHF experience maker's advantage path and D_pef anchors, against the registry.

(The cross-engine check, OpenRLHF maker == local engine on one fixed fake rollout, belongs
next to the local engine's tests once both engines are on one branch.)
"""
from __future__ import annotations

import json
import types

import pytest
from types import SimpleNamespace
import torch

from openrlhf_div.algorithms import get_method
from openrlhf_div.compat import install_flash_attn_standin, install_vllm_stub

install_flash_attn_standin()
install_vllm_stub()

from openrlhf.trainer.ppo_utils.experience import (  # noqa: E402
    Experience,
    make_experience_batch,
    remove_padding_in_sequences,
    split_experience_batch,
)

from openrlhf_div.engines.openrlhf.advantages import rollout_advantages  # noqa: E402
from openrlhf_div.engines.openrlhf.anchors import anchor_experience, append_rows, distribute  # noqa: E402
from openrlhf_div.engines.contract import row_values  # noqa: E402
from openrlhf_div.engines.anchor_data import AnchorRecord, AnchorSampler, anchor_count  # noqa: E402

NS = types.SimpleNamespace
G = 4


def _fake_rollout(seed=0, n_prompts=3, rewards=None):
    g = torch.Generator().manual_seed(seed)
    N = n_prompts * G
    lens = torch.randint(1, 7, (N,), generator=g)
    T = int(lens.max())
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    old = -torch.rand(N, T, generator=g) * 3 * mask
    r = torch.tensor(rewards, dtype=torch.float32) if rewards is not None else (torch.rand(N, generator=g) > 0.5).float()
    return r, old, mask, lens.float()


def _registry(method, r, old, mask, lens):
    """The registry's own calls, in the order its docstring prescribes."""
    seq_mean = (old * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    correct = method.is_correct(r)
    shaped = method.shape_rewards(r, G, seq_mean_old_log_probs=seq_mean, lengths=lens)
    keep = method.keep_groups(correct.float(), G).repeat_interleave(G)  # mixed correctness (DAPO refill)
    adv = method.advantages(shaped, G, old_log_probs=old, mask=mask, correct=correct)
    return adv * keep[:, None], mask * keep[:, None], shaped, keep


CASES = {
    "grpo": {},
    "dapo": {"overlong_max_len": 100, "overlong_cache_len": 10},  # no response reaches the soft zone
    "dapo_short": {"overlong_max_len": 5, "overlong_cache_len": 2},  # lengths 1..6: shaping bites
    "ds_grpo": {"gamma_p": 0.3, "gamma_n": 0.2},
    "unlikeliness": {},
    "passk": {},
    "rloo": {},
}


@pytest.mark.parametrize("name", list(CASES))
def test_rollout_advantages_is_the_registry(name):
    method = get_method(name.replace("_short", ""), **CASES[name])
    # prompt 2 has all-equal rewards: DAPO drops it, the others give it zero advantage
    rewards = [1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 1]
    r, old, mask, lens = _fake_rollout(1, rewards=rewards)
    res = rollout_advantages(method, r, old, mask, G, lengths=lens)
    adv, m, shaped, keep = _registry(method, r, old, mask, lens)
    torch.testing.assert_close(res.advantages, adv)
    torch.testing.assert_close(res.mask, m)
    torch.testing.assert_close(res.shaped_rewards, shaped)
    assert res.correct.tolist() == [bool(x) for x in rewards]
    if name == "dapo":  # dynamic sampling drops the all-equal group (tokens and all)
        assert keep.tolist() == [True] * 8 + [False] * 4 and res.mask[8:].sum() == 0
        assert res.advantages[8:].abs().sum() == 0 and torch.equal(shaped, r)
    elif name == "dapo_short":  # overlong shaping changed the rewards
        assert not torch.equal(shaped, r)
    else:
        assert bool(keep.all())
    if name == "ds_grpo":  # token-level reshaping: advantages vary along a response
        assert (res.advantages[0, :int(lens[0])].unique().numel() > 1) or int(lens[0]) == 1


def test_rollout_advantages_rejects_bad_groups():
    r, old, mask, lens = _fake_rollout(2)
    with pytest.raises(ValueError, match="whole number of groups"):
        rollout_advantages(get_method("grpo"), r[:-1], old[:-1], mask[:-1], G)


# ------------------------------------------------------------------ the maker itself
class _Tok:
    pad_token_id = 0

    def __len__(self):
        return 100


def _maker(method, pool=None, n_samples=G, anchor_batch_size=None):
    from openrlhf_div.engines.openrlhf.experience_maker import DivExperienceMaker

    args = NS(rollout=NS(n_samples_per_prompt=n_samples), data=NS(max_len=64), train=NS(seed=0),
              algo=NS(advantage=NS(estimator="group_norm")),
              div=NS(method=method.name, anchor_batch_size=anchor_batch_size, anchor_ratio=8.0, anchor_seed=0,
                     anchor_data=None))
    return DivExperienceMaker(None, None, None, None, None, NS(args=args), _Tok(), method=method, anchor_pool=pool)


def _micro_batches(r, old, mask, lens, sizes=(5, 4, 3), seed=0):
    """OpenRLHF-style micro-batch Experiences over a *shuffled* rollout order (index = position
    in prompt order), each padded to its own width."""
    N = r.numel()
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
    out, start = [], 0
    for n in sizes:
        idx = perm[start:start + n]
        start += n
        w = int(lens[idx].max())
        P = 2
        seq = torch.randint(1, 50, (n, P + w + 1))
        e = Experience(sequences=seq, attention_mask=torch.ones_like(seq),
                       action_mask=torch.cat([torch.zeros(n, P), mask[idx, :w]], 1).long(),
                       action_log_probs=torch.cat([torch.zeros(n, P), old[idx, :w]], 1),
                       rewards=r[idx].clone(), response_length=lens[idx].clone(),
                       total_length=(lens[idx] + P + 1), truncated=torch.zeros(n, dtype=torch.bool),
                       index=idx.tolist(), prompts=["p"] * n, labels=["l"] * n, images=[None] * n,
                       mm_train_inputs=[None] * n, info={"reward": r[idx].clone()})
        out.append(e)
    return out


@pytest.mark.parametrize("name", ["grpo", "dapo", "dapo_short", "ds_grpo", "unlikeliness"])
def test_experience_maker_matches_registry_on_a_shuffled_rollout(name):
    method = get_method(name.replace("_short", ""), **CASES[name])
    rewards = [1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 1]
    r, old, mask, lens = _fake_rollout(3, rewards=rewards)
    exps = _maker(method).compute_advantages_and_returns(_micro_batches(r, old, mask, lens))
    adv, m, shaped, keep = _registry(method, r, old, mask, lens)
    for e in exps:
        idx = torch.tensor(e.index)
        w = int(lens[idx].max())
        torch.testing.assert_close(e.advantages[:, 2:2 + w], adv[idx, :w])
        assert e.advantages[:, :2].abs().sum() == 0  # prompt positions carry nothing
        torch.testing.assert_close(e.action_mask[:, 2:2 + w].float(), m[idx, :w])
        torch.testing.assert_close(e.info["return"], shaped[idx])
        assert e.info["div_correct"].tolist() == [float(rewards[i]) for i in e.index]
        assert e.info["div_anchor"].sum() == 0 and e.kl is None


def _records(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    recs = []
    for i in range(n):
        p = torch.randint(1, 90, (2 + i % 3,), generator=g).tolist()
        y = torch.randint(1, 90, (1 + i % 4,), generator=g).tolist()
        recs.append(AnchorRecord(prompt_ids=p, response_ids=y, ref_log_probs=(-torch.rand(len(y), generator=g)).tolist(),
                                 id=f"r{i}", prompt=f"P{i}"))
    return recs


def test_anchor_rows_layout_and_truncation():
    recs = _records(3)
    e = anchor_experience(recs, pad_token_id=0, info_keys=("reward",))
    for i, r in enumerate(recs):
        P, R = len(r.prompt_ids), len(r.response_ids)
        assert e.sequences[i, :P + R].tolist() == r.prompt_ids + r.response_ids
        m = e.action_mask[i]
        assert m.sum() == R and m[P - 1:P - 1 + R].all()  # position j scores token j + 1
        torch.testing.assert_close(e.base_action_log_probs[i, P - 1:P - 1 + R], torch.tensor(r.ref_log_probs))
        assert e.base_action_log_probs[i][m == 0].abs().sum() == 0
    assert e.info["div_anchor"].tolist() == [1.0] * 3 and e.info["reward"].tolist() == [0.0] * 3
    short = anchor_experience([AnchorRecord([5, 6], [7, 8, 9], [-1.0, -2.0, -3.0])], 0, max_len=4)
    assert short.sequences.tolist() == [[5, 6, 7, 8]] and short.base_action_log_probs.tolist() == [[0.0, -1.0, -2.0]]
    with pytest.raises(ValueError, match="no room"):
        anchor_experience([AnchorRecord([5, 6, 7], [8], [-1.0])], 0, max_len=3)


def test_anchors_survive_openrlhf_replay_buffer_collation():
    """append rows -> OpenRLHF's split / unpad / re-batch (what its replay buffer does): every
    row keeps its flag, its mask and its stored log-probs, aligned."""
    r, old, mask, lens = _fake_rollout(4)
    online = _maker(get_method("grpo")).compute_advantages_and_returns(_micro_batches(r, old, mask, lens))[0]
    recs = _records(3, seed=5)
    merged = append_rows(online, anchor_experience(recs, 0, info_keys=list(online.info)), pad_token_id=0)
    n_on = online.sequences.shape[0]
    assert merged.sequences.shape[0] == n_on + 3
    items = remove_padding_in_sequences(split_experience_batch(merged))
    batch = make_experience_batch(items[::-1])  # a micro-batch in another order
    flags = row_values(batch.info, "div_anchor", len(items))
    assert flags.tolist() == [1.0] * 3 + [0.0] * n_on
    for row, rec in zip(range(3), recs[::-1]):
        P, R = len(rec.prompt_ids), len(rec.response_ids)
        m = batch.action_mask[row].bool()
        assert m.sum() == R
        torch.testing.assert_close(batch.base_action_log_probs[row][m], torch.tensor(rec.ref_log_probs))
        assert batch.sequences[row, :P + R].tolist() == rec.prompt_ids + rec.response_ids
    # online rows: advantages intact, no stored log-probs
    assert batch.base_action_log_probs[3:].abs().sum() == 0
    assert torch.allclose(batch.advantages[3:].abs().sum(), online.advantages.abs().sum())


def test_maker_attaches_the_configured_number_of_anchors_round_robin():
    method = get_method("dph_f")
    r, old, mask, lens = _fake_rollout(5, n_prompts=4)  # 16 online
    exps = _micro_batches(r, old, mask, lens, sizes=(4, 4, 4, 4))
    mk = _maker(method, pool=AnchorSampler(_records(5), seed=1))
    exps = mk.compute_advantages_and_returns(exps)
    out = mk.attach_anchors(exps)
    assert mk.last_num_anchors == 2  # round(16 / 8)
    per = [int(row_values(e.info, "div_anchor", e.sequences.shape[0]).sum()) for e in out]
    assert per == [1, 1, 0, 0]
    mk2 = _maker(method, pool=AnchorSampler(_records(5), seed=1), anchor_batch_size=6)
    out2 = mk2.attach_anchors(mk2.compute_advantages_and_returns(
        _micro_batches(r, old, mask, lens, sizes=(4, 4, 4, 4))))
    assert [int(row_values(e.info, "div_anchor", e.sequences.shape[0]).sum()) for e in out2] == [2, 2, 1, 1]
    grpo = _maker(get_method("grpo"))
    assert grpo.attach_anchors(exps) is exps and grpo.last_num_anchors == 0


def test_distribute_and_anchor_count():
    assert anchor_count(2048, None, 8.0) == 256 and anchor_count(2048, 100, 8.0) == 100
    assert anchor_count(3, None, 8.0) == 1
    with pytest.raises(ValueError):
        anchor_count(10, None, 0.0)
    with pytest.raises(ValueError, match="empty rollout"):
        distribute([], _records(1), 0)


def test_anchor_sampler_epochs_without_replacement():
    recs = _records(5)
    pool = AnchorSampler(recs, seed=3)
    first = [r.id for r in pool.draw(5)]
    assert sorted(first) == sorted(r.id for r in recs)  # a full pass before any repeat
    again = AnchorSampler(recs, seed=3)
    assert [r.id for r in again.draw(3)] + [r.id for r in again.draw(2)] == first  # deterministic
    state = pool.state_dict()
    nxt = [r.id for r in pool.draw(4)]
    restored = AnchorSampler(recs, seed=0)
    restored.load_state_dict(state)
    assert [r.id for r in restored.draw(4)] == nxt


def test_rows_and_info_helpers():
    assert row_values({"a": [torch.tensor(1.0), torch.tensor(0.0)]}, "a", 2).tolist() == [1.0, 0.0]
    assert row_values({}, "a", 3).tolist() == [0.0] * 3
    with pytest.raises(ValueError, match="3 values for 2 rows"):
        row_values({"a": torch.ones(3)}, "a", 2)


# ------------------------------------------------------------------ Ray-side classes (no Ray started)
def test_driver_swaps_in_our_actor_and_trainer_only_inside_the_context():
    from openrlhf.cli import train_ppo_ray as upstream_cli
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from openrlhf_div.engines.openrlhf.actor import DivPolicyModelActor, _DivPolicyModelActor
    from openrlhf_div.engines.openrlhf.launch import div_classes
    from openrlhf_div.engines.openrlhf.trainer import DivPPOTrainer, _DivPPOTrainer

    assert issubclass(_DivPolicyModelActor, PolicyModelActor.__ray_actor_class__)
    assert issubclass(_DivPPOTrainer, ppo_trainer.PPOTrainer.__ray_actor_class__)
    before = (upstream_cli.PolicyModelActor, ppo_trainer.PPOTrainer)
    with div_classes():
        assert upstream_cli.PolicyModelActor is DivPolicyModelActor
        from openrlhf.trainer.ppo_trainer import PPOTrainer  # what OpenRLHF's train() imports

        assert PPOTrainer is DivPPOTrainer
    assert (upstream_cli.PolicyModelActor, ppo_trainer.PPOTrainer) == before


def test_policy_actor_builds_our_trainer(monkeypatch):
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from openrlhf_div.engines.openrlhf.actor import DivActorPPOTrainer, _DivPolicyModelActor

    seen = []
    monkeypatch.setattr(PolicyModelActor.__ray_actor_class__, "init_model_from_pretrained",
                        lambda self, *a, **k: seen.append(ppo_actor.ActorPPOTrainer))
    actor = object.__new__(_DivPolicyModelActor)
    actor.checkpoint_states = None  # upstream's init sets it (stubbed out here); the step counter reads it
    strategy = SimpleNamespace(load_ckpt=lambda *a, **k: None, is_rank_0=lambda: True, print=print)
    actor.init_model_from_pretrained(strategy, "pretrain")
    assert seen == [DivActorPPOTrainer] and ppo_actor.ActorPPOTrainer is not DivActorPPOTrainer


def test_rollout_stats_exclude_anchor_rows():
    from openrlhf_div.engines.openrlhf.trainer import _DivPPOTrainer

    r, old, mask, lens = _fake_rollout(6, rewards=[1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0])
    exps = _maker(get_method("grpo")).compute_advantages_and_returns(_micro_batches(r, old, mask, lens))
    mixed = [append_rows(e, anchor_experience(_records(2), 0, info_keys=list(e.info)), 0) for e in exps]
    tr = object.__new__(_DivPPOTrainer)
    tr.experience_maker = NS(last_num_anchors=6)
    stats = tr._compute_rollout_stats(mixed)
    assert stats["rollout/num_samples"] == 12.0 and stats["rollout/reward_mean"] == pytest.approx(0.5)
    assert stats["rollout/response_length_mean"] == pytest.approx(float(lens.mean()))
    assert stats["rollout/num_anchor_samples"] == 6.0


def test_logged_reward_and_correct_are_the_online_rows_only():
    """Issue 39 defect 3: on the Ray path `train/reward` / `train/correct` (metrics.jsonl and
    TensorBoard) counted DPH's anchor rows as reward 0 and `div_correct` counted them as correct.
    A step's logged status is the policy actor's (OpenRLHF reduces each per-row figure over all the
    rows it trained on, anchors included) updated with the controller's rollout stats; the
    controller's figures must make every per-row key the online rows' mean, with the anchors under
    keys of their own."""
    from openrlhf_div.engines.openrlhf.actor import DivActorPPOTrainer
    from openrlhf_div.engines.openrlhf.trainer import _DivPPOTrainer
    from openrlhf_div.engines.contract import anchor_rows

    rewards = [1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]  # 4 of 12 online rows correct
    r, old, mask, lens = _fake_rollout(6, rewards=rewards)
    exps = _micro_batches(r, old, mask, lens)
    for e in exps:
        e.info["correct"] = e.info["reward"].clone()  # the reward function's extra_logs["correct"]
    exps = _maker(get_method("dph_js"), pool=AnchorSampler(_records(2), seed=0)).compute_advantages_and_returns(exps)
    mixed = [append_rows(e, anchor_experience(_records(2, seed=i), 0, info_keys=[k for k in e.info
                                                                                if k not in ("div_anchor", "div_correct")]), 0)
             for i, e in enumerate(exps)]
    # the actor's status, as OpenRLHF's ppo_train reduces it (sample-weighted over every row)
    actor = object.__new__(DivActorPPOTrainer)
    actor.actor_scheduler = NS(get_last_lr=lambda: [0.0])
    sums, rows = {}, 0
    for e in mixed:
        B = int(e.sequences.shape[0])
        st = actor._status(e, torch.tensor(0.0), {}, anchor_rows(e.info, B), False)
        for k in ("reward", "correct", "div_correct"):
            sums[k] = sums.get(k, 0.0) + float(st["metrics"][k].float().mean()) * B
        rows += B
    status = {k: v / rows for k, v in sums.items()}
    assert status["reward"] < 4 / 12 and status["div_correct"] > 4 / 12  # what the old logs showed
    tr = object.__new__(_DivPPOTrainer)
    tr.experience_maker = NS(last_num_anchors=6)
    status.update(tr._compute_rollout_stats(mixed))  # OpenRLHF's train_step merges them so
    assert status["reward"] == pytest.approx(4 / 12) == status["rollout/reward_mean"]
    assert status["correct"] == pytest.approx(4 / 12) and status["div_correct"] == pytest.approx(4 / 12)
    assert status["return"] == pytest.approx(4 / 12)
    assert status["anchor/num_samples"] == 6.0
    an_len = [len(rec.response_ids) for i in range(3) for rec in _records(2, seed=i)]
    assert status["anchor/response_length"] == pytest.approx(sum(an_len) / 6)
    # a method without anchors: the same figures as the actor's (nothing to exclude)
    plain = _maker(get_method("grpo")).compute_advantages_and_returns(_micro_batches(r, old, mask, lens))
    st = tr._compute_rollout_stats(plain)
    assert st["reward"] == pytest.approx(4 / 12) and "anchor/num_samples" not in st


def test_maker_reads_d_pef_through_the_shared_reader(tmp_path):
    """The experience maker reads D_pef with the engine-neutral reader: an empty D_pef names the
    pre-sampling histogram and --presample.tau, and base log-probs pre-sampled at another
    temperature than --rollout.temperature are refused (the local engine's check, which the
    OpenRLHF engine lacked before the anchor data had one home)."""
    from openrlhf_div.engines.anchor_data import EmptyAnchorError
    from openrlhf_div.engines.openrlhf.experience_maker import DivExperienceMaker

    def maker(temperature):
        args = NS(rollout=NS(n_samples_per_prompt=G, temperature=temperature), data=NS(max_len=64),
                  train=NS(seed=0), algo=NS(advantage=NS(estimator="group_norm")),
                  div=NS(method="dph_js", anchor_batch_size=None, anchor_ratio=8.0, anchor_seed=None,
                         anchor_data=str(tmp_path)))
        return DivExperienceMaker(None, None, None, None, None, NS(args=args), _Tok(), method=get_method("dph_js"))

    (tmp_path / "summary.json").write_text(json.dumps({"temperature": 1.0, "n_prompts": 2, "n_pre": 2, "tau": 2,
                                                       "correct_histogram": [1, 1, 0]}))
    (tmp_path / "d_pef.jsonl").write_text("")
    with pytest.raises(EmptyAnchorError, match=r"--presample.tau 1"):
        maker(1.0)
    rec = {"prompt_ids": [1, 2], "response_ids": [3], "ref_log_probs": [-0.5], "id": "a"}
    (tmp_path / "d_pef.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match="temperature 1.0 but --rollout.temperature is 0.6"):
        maker(0.6)
    mk = maker(1.0)
    assert [r.id for r in mk.anchor_pool.draw(2)] == ["a", "a"] and mk.anchor_pool.seed == 0
