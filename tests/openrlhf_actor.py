"""Shared helpers of the OpenRLHF actor-step tests (a plain module, not a test file: imported by
name, tests/conftest.py puts tests/ on sys.path): DeepSpeed on CPU at world size 1 (the ``world``
and ``trainer`` fixtures), a tiny Qwen2 model folder, a fake rollout in OpenRLHF's layout with
registry advantages, anchor rows, and the registry loss on an independent plain forward.

Used by tests/test_openrlhf_actor_step.py and tests/test_custom_method.py.

Two CPU-only adjustments, both test-side (see docs/scaling.md "CPU checks"): DeepSpeed's
shared-memory collective op and FusedAdam are C++ extensions JIT-compiled on first use, so the
``world`` fixture disables the former (world size 1 needs no collective) and the trainer asks
DeepSpeed for ``torch_adam``; OpenRLHF's ``ActorPPOTrainer`` constructor calls
``torch.cuda.synchronize`` / ``torch.cuda.current_device`` unconditionally, so those two are
pointed at the CPU while the trainer is built.
"""
from __future__ import annotations

import os
import socket
import types

import pytest
import torch

NS = types.SimpleNamespace
V = 48  # tiny vocabulary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_model_dir(path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(path))
    hf_tok.save_pretrained(str(path))
    return str(path)


def _args(micro: int, train_batch: int, method_name: str, layout=None):
    """``layout``: the run's ``layout:`` section (``{"step_layout": "authors"}``; None: defaults)."""
    return NS(
        ds=NS(param_dtype="bf16", zero_stage=0, adam_offload=False, zpg=1, use_universal_ckpt=False,
              grad_accum_dtype=None, overlap_comm=False, deepcompile=False, tensor_parallel_size=1,
              ring_attn_size=1, packing_samples=False, attn_implementation="sdpa"),
        train=NS(dynamic_batch_enable=False, max_epochs=1, seed=0, colocate_all=False, async_enable=False,
                 micro_batch_size=micro, batch_size=train_batch),
        actor=NS(eps_clip_low_high=(0.2, 0.2), dual_clip=None, loss_agg_mode="token-mean",
                 policy_loss_type="ppo", aux_loss_coef=0, entropy_coef=None, adam=NS(lr=1e-2)),
        algo=NS(advantage=NS(is_correction_level="off", is_correction_mode="mask", is_correction_gating="ratio",
                             is_correction_threshold=(0.5, 5.0)), kl=NS(use_loss=False)),
        vllm=NS(sync_backend="gloo"), local_rank=-1,
        div=NS(method=method_name, anchor_data=None), engine=NS(**(layout or {})),
    )


class _Env:
    """DeepSpeed on CPU at world size 1 in this process, restored afterwards."""

    KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR")

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.KEYS}
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0", DS_ACCELERATOR="cpu")
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from openrlhf_div.compat import install_flash_attn_standin, install_vllm_stub

    install_flash_attn_standin()
    install_vllm_stub()
    env = _Env().__enter__()
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    # JIT-compiling DeepSpeed's shared-memory collective takes minutes and world size 1 needs none.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    created = not dist.is_initialized()
    deepspeed.init_distributed(dist_backend="gloo")
    model_dir = _tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen2"))
    yield NS(model_dir=model_dir)
    if created and dist.is_initialized():
        dist.destroy_process_group()
        # DeepSpeed caches its process groups in module globals (deepspeed/utils/groups.py:
        # _WORLD_GROUP, ...); a stale one makes the next module that builds this fixture
        # (tests/test_custom_method.py builds it too) fail with "Group ... is not registered".
        from deepspeed.utils import groups as ds_groups

        for name in [n for n in vars(ds_groups) if n.startswith("_") and "GROUP" in n and n.isupper()]:
            value = getattr(ds_groups, name)
            setattr(ds_groups, name, {} if isinstance(value, dict) else None)
    env.__exit__()


def _build_trainer(world, monkeypatch, *, micro: int, train_batch: int, method, layout=None):
    from torch.distributed.device_mesh import init_device_mesh

    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf_div.engines.openrlhf.actor import DivActorPPOTrainer
    # what DivPolicyModelActor builds instead of OpenRLHF's Actor: log-probs from hidden states
    from openrlhf_div.engines.openrlhf.logprob_actor import HiddenLogProbActor as Actor

    args = _args(micro, train_batch, method.name, layout)
    strategy = DeepspeedStrategy(seed=0, micro_train_batch_size=micro, train_batch_size=train_batch,
                                 zero_stage=0, args=args)
    # setup_distributed() minus its CUDA device mesh: the same fields on a CPU mesh.
    strategy.world_size = 1
    strategy.ds_device_mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "sp", "tp"))
    strategy.ring_attn_rank = 0
    strategy.accumulated_gradient = train_batch // micro
    upstream_cfg = strategy.get_ds_train_config

    def ds_config(*a, **k):  # torch AdamW instead of the JIT-compiled FusedAdam
        cfg = upstream_cfg(*a, **k)
        if "optimizer" in cfg:
            cfg["optimizer"]["params"]["torch_adam"] = True
        return cfg

    strategy.get_ds_train_config = ds_config
    actor = Actor(world.model_dir, attn_implementation="sdpa", param_dtype="bf16",
                  ds_config=strategy.get_ds_train_config())
    cfg = dict(optim="adam", adam=dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
               lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.1, max_norm=1.0,
               scheduler_steps=100)
    actor, optim, sched = strategy.prepare((actor, cfg))
    # OpenRLHF's constructor syncs CUDA and reads the CUDA device unconditionally.
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: torch.distributed.barrier())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    trainer = DivActorPPOTrainer(strategy, actor, ema_model=None, actor_optim=optim, actor_scheduler=sched,
                                 micro_train_batch_size=micro, tokenizer=None, vllm_engines=None, method=method)
    assert isinstance(trainer, ppo_actor.ActorPPOTrainer)
    return trainer


@pytest.fixture(scope="module")
def trainer(world):
    from openrlhf_div.algorithms import get_method

    mp = pytest.MonkeyPatch()
    try:
        yield _build_trainer(world, mp, micro=4, train_batch=4, method=get_method("grpo"))
    finally:
        mp.undo()


# ----------------------------------------------------------------------------- batches
def _plain_log_probs(trainer, sequences, attention_mask, width):
    """Per-token log-probs of the *current* weights by a plain HF forward (not OpenRLHF's Actor)."""
    model = trainer.actor.model.module  # the HF model inside the DeepSpeed engine
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention_mask, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
    return lp[:, -width:]


def _rollout(trainer, method, rewards, seed=0, prompt_len=3, resp_lens=(5, 3, 4, 2)):
    """A fake rollout of one prompt group in OpenRLHF's layout with registry advantages."""
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.utils.utils import zero_pad_sequences
    from openrlhf_div.engines.openrlhf.advantages import rollout_advantages

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, V, (prompt_len,), generator=g)
    seqs, masks = [], []
    for L in resp_lens:
        resp = torch.randint(2, V, (L,), generator=g)
        seqs.append(torch.cat([prompt, resp]))
        m = torch.zeros(prompt_len + L, dtype=torch.long)
        m[prompt_len:] = 1
        masks.append(m[1:])
    sequences = zero_pad_sequences(seqs, "right", value=0, stack=True)
    attention = zero_pad_sequences([torch.ones_like(s) for s in seqs], "right", stack=True)
    action_mask = zero_pad_sequences(masks, "right", stack=True)
    A = action_mask.shape[1]
    lp = _plain_log_probs(trainer, sequences, attention, A)
    noise = 0.15 * torch.randn(lp.shape, generator=g)  # pi_old != pi_theta: ratios away from 1
    old = (lp + noise) * action_mask
    r = torch.tensor(rewards, dtype=torch.float32)
    res = rollout_advantages(method, r, old, action_mask, group_size=len(rewards),
                             lengths=torch.tensor(resp_lens, dtype=torch.float32))
    n = len(resp_lens)
    ref = None
    if method.needs.ref_log_probs:  # what the reference actor would ship with --algo.kl.use_loss
        ref = (lp - 0.2 * torch.rand(lp.shape, generator=g)) * action_mask
    return Experience(
        sequences=sequences, attention_mask=attention, action_mask=res.mask.long(), action_log_probs=old,
        base_action_log_probs=ref,
        advantages=res.advantages, returns=res.advantages.clone(), rewards=r,
        response_length=torch.tensor(resp_lens, dtype=torch.float32),
        total_length=attention.sum(-1).float(), truncated=torch.zeros(n, dtype=torch.bool),
        index=list(range(n)), prompts=["p"] * n, labels=["l"] * n, images=[None] * n, mm_train_inputs=[None] * n,
        info={"reward": r.clone(), "div_anchor": torch.zeros(n), "div_correct": res.correct.float()},
    )


def _anchor_rows(trainer, n=2, seed=1):
    from openrlhf_div.engines.openrlhf.anchors import anchor_experience
    from openrlhf_div.engines.anchor_data import AnchorRecord

    g = torch.Generator().manual_seed(seed)
    recs = []
    for i in range(n):
        p = torch.randint(2, V, (2 + i,), generator=g).tolist()
        y = torch.randint(2, V, (3 + 2 * i,), generator=g).tolist()
        ids = torch.tensor([p + y])
        lp = _plain_log_probs(trainer, ids, torch.ones_like(ids), len(p) + len(y) - 1)[0, len(p) - 1:]
        ref = (lp - 0.3 * torch.rand(lp.shape, generator=g)).clamp(max=0.0)  # the stored base log-probs
        recs.append(AnchorRecord(prompt_ids=p, response_ids=y, ref_log_probs=ref.tolist(), id=f"a{i}"))
    return anchor_experience(recs, pad_token_id=0, info_keys=("reward",))


def _plain_log_z(trainer, exp):
    """FlowRL's log Z from the trainer's head on prompt states of a plain forward."""
    from openrlhf_div.engines.openrlhf.actor import mean_prompt_hidden

    model = trainer.actor.model.module
    pos = (exp.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        h = model(input_ids=exp.sequences, attention_mask=exp.attention_mask, position_ids=pos,
                  output_hidden_states=True).hidden_states[-1]
        return trainer.log_z_head(mean_prompt_hidden(h, exp.attention_mask, exp.action_mask))


def _registry_loss(trainer, method, exp, norm=None):
    """``Method.loss`` on the experience's rows, log-probs from the plain forward."""
    from openrlhf_div.algorithms import AnchorInputs, LossInputs

    A = exp.action_mask.shape[1]
    lp = _plain_log_probs(trainer, exp.sequences, exp.attention_mask, A)
    is_anchor = exp.info["div_anchor"] > 0.5
    m = exp.action_mask.float()
    on, an = ~is_anchor, is_anchor
    online = anchor = None
    if on.any():
        ref = exp.base_action_log_probs[on].float() if method.needs.ref_log_probs else None
        log_z = _plain_log_z(trainer, exp)[on] if method.needs.prompt_hidden else None
        online = LossInputs(log_probs=lp[on], old_log_probs=exp.action_log_probs[on].float(),
                            advantages=exp.advantages[on].float(), mask=m[on],
                            correct=exp.info["div_correct"][on] > 0.5, ref_log_probs=ref, log_z=log_z)
    if an.any():
        anchor = AnchorInputs(log_probs=lp[an], ref_log_probs=exp.base_action_log_probs[an].float(), mask=m[an])
    norm = norm or {}
    loss, _ = method.loss(online=online, anchor=anchor, num_online_tokens=norm.get("online"),
                          num_anchor_tokens=norm.get("anchor"), num_online_seqs=norm.get("online_seqs"))
    return float(loss)


def _norm_info(exp):
    """OpenRLHF-style loss_batch_info for one micro-batch that is a whole step (dp 1, gas 1)."""
    a = exp.info["div_anchor"] > 0.5
    m = exp.action_mask.float()
    on_tok, an_tok = float(m[~a].sum()), float(m[a].sum())
    info = {"dp_size": 1, "batch_num_tokens": torch.tensor(on_tok),
            "global_batch_size": torch.tensor(float((m[~a].sum(-1) > 0).sum())),
            "anchor": {"dp_size": 1, "batch_num_tokens": torch.tensor(an_tok),
                       "global_batch_size": torch.tensor(float((m[a].sum(-1) > 0).sum()))}}
    return info, {"online": on_tok, "anchor": an_tok, "online_seqs": float((m[~a].sum(-1) > 0).sum())}


def _params(trainer):
    return torch.cat([p.detach().float().reshape(-1) for p in trainer.actor.model.module.parameters()])


def _step(trainer, method, exp):
    trainer.div_method = method
    info, counts = _norm_info(exp)
    expected = _registry_loss(trainer, method, exp, counts)
    before = _params(trainer)
    status = trainer.training_step(exp, 0.0, 0, info)
    after = _params(trainer)
    return expected, float(trainer.last_loss), status, (after - before).abs().max().item()
