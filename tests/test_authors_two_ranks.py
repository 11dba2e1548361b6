"""The DPH-RL authors' update loop at two real ranks (issue 35): the Megatron policy actor (no Ray:
the plain class in 2 gloo processes, TP 1, DP 2, megatron-core's distributed optimizer) trains one
rollout step of dph_f laid out as the authors' code did on 2 GPUs (``layout.authors_world_size: 2``,
``step_layout: authors``, micro-batches of 2 rows, ``mixed_micro_batches: first_row``) through the
engine's own path: each rank appends its own experience, ``fit`` gathers the step's rows over the
data-parallel group (``contract.gather_step_rows``: ``all_gather_object``), plans the authors'
optimiser steps, runs this replica's share of each step's micro-batches and reduces the gradients
over the two replicas.

The reference is a single process: the same tiny Hugging Face model, the step's 20 rows (rank 0's,
then rank 1's), the independent transcription of the authors' loop in ``tests/test_authors_replay.py``
(``authors_plan`` at world 2: balance_batch reorder, contiguous rank chunks, per-GPU mini-batches,
first-row routing, ``1 / W`` gradient mean) and torch's AdamW, step by step. The weights after the
three optimiser steps must agree; they do not agree with the same transcription at world 1 (the
authors' one-GPU form), so the comparison can tell the layouts apart. Cost: ~40 s (two processes).
"""
import os
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("megatron.core")

from openrlhf_div.compat.mcore_cpu import run_multiprocess  # noqa: E402
from test_megatron_actor_cpu import tiny_dir  # noqa: E402  (the same tiny HF model, vocab V)
from test_authors_replay import ETA as REPLAY_ETA  # noqa: E402
from test_authors_replay import CLIP_C, EPS_HIGH, EPS_LOW, authors_micro_loss, authors_plan  # noqa: E402

pytestmark = pytest.mark.slow
V, TEMP, LR, EPS = 40, 0.8, 1e-2, 1e-3
ETA = REPLAY_ETA  # the transcription's anchor weight (authors_micro_loss)
P, L = 3, 12                 # prompt tokens, row width (prompt + response, right-padded)
N_ROLL, N_ANCHOR = 8, 2      # per rank: 8 rollouts then 2 anchors (20 rows in the rollout step)
WORLD = 2                    # the authors' GPU count this run reproduces
ROWS_PER_STEP = 8            # train.batch_size: the authors' rows per optimiser step (4 per GPU at W = 2)
MICRO = 2


def log_probs(model, seq, am):
    logits = model(seq, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    return torch.log_softmax(logits.float()[:, :-1] / TEMP, -1).gather(-1, seq[:, 1:, None])[..., 0]


def make_data(model):
    """Per rank: sequences, masks, old / stored log-probs near the model's, advantages, anchor flags."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(WORLD):
        B = N_ROLL + N_ANCHOR
        seq = torch.randint(0, V, (B, L), generator=g)
        lens = torch.randint(P + 2, L + 1, (B,), generator=g)
        am = (torch.arange(L)[None] < lens[:, None]).long()
        act = torch.zeros(B, L - 1)
        for i in range(B):
            act[i, P - 1:int(lens[i]) - 1] = 1
        with torch.no_grad():
            lp = log_probs(model, seq, am)
        old = (lp + 0.05 * torch.randn(B, L - 1, generator=g)) * act
        stored = (lp - 0.3 * torch.rand(B, L - 1, generator=g)) * act
        adv = torch.randn(B, 1, generator=g) * act
        anchor = [i >= N_ROLL for i in range(B)]
        out.append(dict(sequences=seq, attention_mask=am, action_mask=act, old=old, stored=stored, adv=adv,
                        anchor=anchor))
    return out


def make_args(tmp):
    hp = [f"anchor_eta={ETA}", "anchor_weighting=microbatch_share", "aggregation=micro-batch-token-mean",
          f"micro_batch_seqs={MICRO}", f"eps_low={EPS_LOW}", f"eps_high={EPS_HIGH}", f"dual_clip={CLIP_C}"]
    return NS(
        megatron=NS(tp=1, pp=1, bf16=False, vocab_divisor=8, distributed_optimizer=True),
        div=NS(method="dph_f", actor_backend="megatron", hparams=hp),
        engine=NS(step_layout="authors", micro_batch_tokens=None, authors_world_size=WORLD,
                  mixed_micro_batches="first_row"),
        train=NS(seed=3, micro_batch_size=MICRO, batch_size=ROWS_PER_STEP, max_epochs=1, colocate_all=False,
                 async_enable=False),
        actor=NS(optim="adam", adam=NS(lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0), max_norm=1e9,
                 lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.1),
        rollout=NS(temperature=TEMP), vllm=NS(sync_backend="nccl"),
        ckpt=NS(path=os.path.join(tmp, "ckpt"), load_enable=False, max_num=2, save_hf=False, disable_ds=False,
                output_dir=os.path.join(tmp, "hf_out")),
        ds=NS(ring_attn_size=1, packing_samples=False, tensor_parallel_size=1))


def _worker(rank, world, tmp):
    from openrlhf.trainer.ppo_utils.experience import Experience

    from openrlhf_div.engines.megatron.actor import MegatronPolicyActor

    d = torch.load(os.path.join(tmp, "data.pt"))[rank]    # this rank's rows only, as OpenRLHF hands them out
    exp = Experience(sequences=d["sequences"], attention_mask=d["attention_mask"], action_mask=d["action_mask"],
                     action_log_probs=d["old"], base_action_log_probs=d["stored"], advantages=d["adv"],
                     info={"reward": torch.zeros(len(d["anchor"])),
                           "div_anchor": [torch.tensor(float(a)) for a in d["anchor"]]})
    a = MegatronPolicyActor(world, rank, "127.0.0.1", None)
    a.init_model_from_pretrained(NS(args=make_args(tmp)), os.path.join(tmp, "hf"), max_steps=5)
    a.execute_batch("append", dict(experience=[exp]), 0, 1)
    steps = a._steps()
    status = a.fit()
    return {"steps": len(steps), "after": a.engine.hf_state_dict(), "status": status}


def reference(model, data, world):
    """The transcription of the authors' loop at ``world`` GPUs on the whole step, with AdamW."""
    cat = {k: torch.cat([d[k] for d in data]) for k in ("sequences", "attention_mask", "action_mask", "old",
                                                        "stored", "adv")}
    types = [2 if a else 1 for d in data for a in d["anchor"]]
    attn = [int(x) for x in cat["attention_mask"].sum(-1)]
    plan = authors_plan(types, attn, world, ROWS_PER_STEP // world, MICRO)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)
    for step in plan:
        lp = log_probs(model, cat["sequences"], cat["attention_mask"])
        total = lp.sum() * 0.0
        for _, rows, factor in step:
            idx = torch.tensor(rows)
            loss = authors_micro_loss(types, rows, lp[idx], cat["stored"][idx], cat["old"][idx], cat["adv"][idx],
                                      cat["action_mask"][idx])
            total = total + loss * factor / world   # FSDP: the mean of the ranks' gradients
        opt.zero_grad()
        total.backward()
        opt.step()
    return len(plan), {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_real_ranks_train_as_the_authors_did_on_two_gpus(tmp_path):
    tmp = str(tmp_path)
    model = tiny_dir(os.path.join(tmp, "hf"))
    data = make_data(model)
    torch.save(data, os.path.join(tmp, "data.pt"))
    res = run_multiprocess(_worker, world_size=2, args=(tmp,), timeout=240)
    n_ref, want = reference(tiny_dir(os.path.join(tmp, "hf_ref")), data, WORLD)
    assert n_ref == 3 and res[0]["steps"] == res[1]["steps"] == 3
    diff_w2 = max(float((res[0]["after"][k] - v).abs().max()) for k, v in want.items())
    for k, v in want.items():
        torch.testing.assert_close(res[0]["after"][k], v, rtol=1e-4, atol=1e-6, msg=k)
        assert torch.equal(res[0]["after"][k], res[1]["after"][k]), k   # the replicas agree
    # the comparison tells the authors' two-GPU layout from their one-GPU form
    _, one_gpu = reference(tiny_dir(os.path.join(tmp, "hf_ref1")), data, 1)
    diff_w1 = max(float((res[0]["after"][k] - v).abs().max()) for k, v in one_gpu.items())
    print(f"two real ranks vs the replay: max weight difference {diff_w2:.3g} at world 2, {diff_w1:.3g} at world 1")
    assert diff_w1 > 100 * max(diff_w2, 1e-7), (diff_w1, diff_w2)
