"""The DPH-RL authors' update loop at two real ranks on the DeepSpeed actor (issue 43 item 8; the
Megatron twin is tests/test_authors_two_ranks.py): OpenRLHF's ``ActorPPOTrainer`` with our loss
(:class:`~openrlhf_div.engines.openrlhf.actor.DivActorPPOTrainer`) on a real DeepSpeed engine (CPU
accelerator, ZeRO-0, float32), in 2 gloo processes (data-parallel 2), trains one rollout step of
dph_f laid out as the authors' code did on 2 GPUs (``layout.authors_world_size: 2``,
``step_layout: authors``, micro-batches of 2 rows, ``mixed_micro_batches: first_row``): each rank
appends its own rows to its replay buffer, ``ppo_train`` gathers the step's rows over the
data-parallel group, plans the authors' optimiser steps, runs this replica's micro-batches and
DeepSpeed averages the gradients over the two replicas.

The reference is the same as the Megatron test's: one process, the same float32 model, the step's
20 rows (rank 0's, then rank 1's), the transcription of the authors' loop
(``tests/test_authors_replay.py``: ``authors_plan`` at world 2) and torch's AdamW. The weights after
the rollout step equal it, and differ from the transcription at world 1 (the authors' one-GPU
form) by far more. Cost: ~30-60 s (two processes importing DeepSpeed and OpenRLHF).
"""
import os
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("openrlhf")

from openrlhf_div.compat.mcore_cpu import run_multiprocess  # noqa: E402
from test_authors_two_ranks import (  # noqa: E402  (the Megatron twin's data, model and reference)
    EPS, ETA, L, LR, MICRO, N_ANCHOR, N_ROLL, ROWS_PER_STEP, TEMP, WORLD, make_data, reference)
from test_authors_replay import CLIP_C, EPS_HIGH, EPS_LOW  # noqa: E402
from test_megatron_actor_cpu import tiny_dir  # noqa: E402

pytestmark = pytest.mark.slow


def make_args():
    return NS(
        ds=NS(param_dtype="fp32", zero_stage=0, adam_offload=False, zpg=1, use_universal_ckpt=False,
              grad_accum_dtype=None, overlap_comm=False, deepcompile=False, tensor_parallel_size=1,
              ring_attn_size=1, packing_samples=False, attn_implementation="sdpa"),
        train=NS(dynamic_batch_enable=False, max_epochs=1, seed=3, colocate_all=False, async_enable=False,
                 micro_batch_size=MICRO, batch_size=ROWS_PER_STEP),
        actor=NS(eps_clip_low_high=(EPS_LOW, EPS_HIGH), dual_clip=CLIP_C, loss_agg_mode="token-mean",
                 policy_loss_type="ppo", aux_loss_coef=0, entropy_coef=None,
                 adam=NS(lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)),
        algo=NS(advantage=NS(is_correction_level="off", is_correction_mode="mask", is_correction_gating="ratio",
                             is_correction_threshold=(0.5, 5.0)), kl=NS(use_loss=False)),
        rollout=NS(temperature=TEMP), vllm=NS(sync_backend="gloo"), local_rank=-1,
        div=NS(method="dph_f", anchor_data=None),
        engine=NS(step_layout="authors", micro_batch_tokens=None, authors_world_size=WORLD,
                  mixed_micro_batches="first_row"))


def _worker(rank, world, tmp):
    os.environ["DS_ACCELERATOR"] = "cpu"
    from openrlhf_div.compat import cpu_seams, install_flash_attn_standin

    install_flash_attn_standin()
    cpu_seams.install_import_hooks()  # the CPU path's seams (torch.cuda calls, CPU mesh, torch AdamW)
    cpu_seams._patch_torch()
    import deepspeed
    import deepspeed.ops
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2ForCausalLM

    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    from openrlhf_div.algorithms import get_method
    from openrlhf_div.engines.openrlhf.actor import DivActorPPOTrainer
    from openrlhf_div.engines.openrlhf.logprob_actor import HiddenLogProbActor

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # the gloo group run_multiprocess made
    args = make_args()
    strategy = DeepspeedStrategy(seed=3, micro_train_batch_size=MICRO, train_batch_size=ROWS_PER_STEP, zero_stage=0,
                                 max_norm=1e9, args=args)
    # setup_distributed() minus CUDA: the same fields on a CPU mesh (data-parallel 2)
    strategy.world_size = world
    strategy.ds_device_mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("dp", "sp", "tp"))
    strategy.ring_attn_rank = 0
    strategy.accumulated_gradient = ROWS_PER_STEP // MICRO // world
    model = Qwen2ForCausalLM.from_pretrained(os.path.join(tmp, "hf"), torch_dtype=torch.float32)
    model.config.use_cache = False
    actor = HiddenLogProbActor(model, temperature=TEMP)
    actor.packing_samples, actor.is_vlm = False, False  # what Actor sets when it loads the model itself
    cfg = dict(optim="adam", adam=dict(lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0), lr_scheduler="constant",
               lr_warmup_ratio=0.0, min_lr_ratio=0.1, max_norm=1e9, scheduler_steps=100)
    actor, optim, sched = strategy.prepare((actor, cfg))
    ppo_actor.torch_dist_barrier_and_cuda_sync = lambda: torch.distributed.barrier()
    method = get_method("dph_f", anchor_eta=ETA, anchor_weighting="microbatch_share",
                        aggregation="micro-batch-token-mean", micro_batch_seqs=MICRO, eps_low=EPS_LOW,
                        eps_high=EPS_HIGH, dual_clip=CLIP_C)
    trainer = DivActorPPOTrainer(strategy, actor, ema_model=None, actor_optim=optim, actor_scheduler=sched,
                                 micro_train_batch_size=MICRO, tokenizer=None, vllm_engines=None, method=method)
    d = torch.load(os.path.join(tmp, "data.pt"))[rank]  # this rank's rows only, as OpenRLHF hands them out
    n = len(d["anchor"])
    exp = Experience(sequences=d["sequences"], attention_mask=d["attention_mask"],
                     action_mask=d["action_mask"].bool(), action_log_probs=d["old"],
                     base_action_log_probs=d["stored"], advantages=d["adv"].expand_as(d["old"]).contiguous(),
                     returns=d["adv"].expand_as(d["old"]).contiguous(),
                     response_length=d["action_mask"].sum(-1).float(), total_length=d["attention_mask"].sum(-1).float(),
                     info={"reward": torch.zeros(n), "div_anchor": torch.tensor([float(a) for a in d["anchor"]]),
                           "div_correct": torch.zeros(n)})
    trainer.replay_buffer.append(exp)
    trainer.ppo_train(0.0)
    steps = int(actor.model.global_steps)
    return {"steps": steps, "after": {k: v.detach().clone() for k, v in actor.model.module.state_dict().items()}}


def test_two_real_deepspeed_ranks_train_as_the_authors_did_on_two_gpus(tmp_path):
    tmp = str(tmp_path)
    model = tiny_dir(os.path.join(tmp, "hf"))
    data = make_data(model)
    assert all(len(d["anchor"]) == N_ROLL + N_ANCHOR for d in data) and data[0]["sequences"].shape[1] == L
    torch.save(data, os.path.join(tmp, "data.pt"))
    res = run_multiprocess(_worker, world_size=2, args=(tmp,), timeout=240)
    n_ref, want = reference(tiny_dir(os.path.join(tmp, "hf_ref")), data, WORLD)
    assert n_ref == 3 and res[0]["steps"] == res[1]["steps"] == 3, (n_ref, res[0]["steps"])
    diff_w2 = max(float((res[0]["after"][k] - v).abs().max()) for k, v in want.items())
    for k, v in want.items():
        torch.testing.assert_close(res[0]["after"][k], v, rtol=1e-4, atol=1e-6, msg=k)
        assert torch.equal(res[0]["after"][k], res[1]["after"][k]), k   # the replicas agree
    _, one_gpu = reference(tiny_dir(os.path.join(tmp, "hf_ref1")), data, 1)
    diff_w1 = max(float((res[0]["after"][k] - v).abs().max()) for k, v in one_gpu.items())
    print(f"two DeepSpeed ranks vs the replay: max weight difference {diff_w2:.3g} at world 2, {diff_w1:.3g} at world 1")
    assert diff_w1 > 100 * max(diff_w2, 1e-7), (diff_w1, diff_w2)
