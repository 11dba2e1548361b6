"""The policy actor: OpenRLHF's ``PolicyModelActor`` whose training step takes its loss from the
method registry.

* :class:`DivActorPPOTrainer` subclasses OpenRLHF's ``ActorPPOTrainer``. Its
  :meth:`~DivActorPPOTrainer.training_step` runs the same forward, backward, optimizer and
  EMA steps as OpenRLHF's, but the loss is :func:`~openrlhf_div.engines.openrlhf.loss.div_actor_loss`:
  the registry's per-token online and anchor losses, each reduced by OpenRLHF's
  ``aggregate_loss`` with the ``loss_batch_info`` it receives. Its
  :meth:`~DivActorPPOTrainer.ppo_train` is OpenRLHF's, with the per-optimizer-step normaliser
  extended to count online and anchor tokens separately (:func:`split_window_norms`).
* :data:`DivPolicyModelActor` is ``ray.remote`` of a subclass of
  ``PolicyModelActor.__ray_actor_class__`` (Ray refuses to subclass an actor class directly)
  that builds :class:`DivActorPPOTrainer` instead of ``ActorPPOTrainer``. Both are built on first
  access (module ``__getattr__``), so this module itself never imports ``ray``
  (``openrlhf.trainer.ray.ppo_actor`` still does: without Ray, one-process runs such as the GPU
  bench install their own import stub first: benchmarks/ray_import_stub.py).

OpenRLHF hard-codes both classes by module-level name; we swap each name only for the
duration of one call *inside the actor's own process* (:func:`_swapped`), so nothing leaks
into other actors or the driver.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from openrlhf_div.algorithms.heads import make_log_z_head
from openrlhf_div.compat.flash_attn_standin import install as _install_flash_attn_standin

_install_flash_attn_standin()

from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ray import ppo_actor as _ppo_actor  # noqa: E402
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor  # noqa: E402
from openrlhf.utils.loss_utils import get_loss_batch_info  # noqa: E402
from openrlhf.utils.vlm_utils import merge_mm_train_inputs  # noqa: E402

from ..contract import anchor_rows, correct_rows, gather_step_rows, row_values  # noqa: E402
from ..contract import ANCHOR_FLAG  # noqa: E402
from ..flags import check_supported, method_from_args  # noqa: E402
from ..layout import EngineLayout, uses_authors_layout  # noqa: E402
from .checkpoints import (TAG_RE, check_finite_scalar, read_latest, resolve_resume_tag,  # noqa: E402
                          save_actor_checkpoint)
from .loss import (AUTHORS_KEY, authors_micro_batches, div_actor_loss, split_masks,  # noqa: E402
                   split_window_norms)


from openrlhf_div.compat.patch import swapped as _swapped  # noqa: E402 (shared with the reference actor)


def mean_prompt_hidden(hidden: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``hidden [B, T, H]`` over each row's prompt tokens: the attended tokens before the
    first response token (``action_mask`` position ``j`` marks token ``j + 1``)."""
    B, T = attention_mask.shape
    resp = torch.zeros(B, T, device=hidden.device)
    resp[:, T - action_mask.shape[1]:] = action_mask.float()
    prompt = attention_mask.float() * (resp.cumsum(-1) == 0).float()
    pm = prompt.unsqueeze(-1).to(hidden.dtype)
    return (hidden * pm).sum(1).float() / pm.sum(1).float().clamp(min=1.0)


class DivActorPPOTrainer(ActorPPOTrainer):
    """``ActorPPOTrainer`` with the registry's loss (see the module docstring)."""

    def __init__(self, strategy, *args, method=None, **kwargs):
        super().__init__(strategy, *args, **kwargs)
        self.div_method = method if method is not None else method_from_args(strategy.args)
        self.div_layout = EngineLayout.from_args(strategy.args)
        check_supported(self.div_method, strategy.args, need_data=False)
        self._div_generator = torch.Generator().manual_seed(int(getattr(self.args.train, "seed", 0)))
        self.last_loss: Optional[torch.Tensor] = None  # the loss handed to backward (for checks)
        self.div_step = 0  # the rollout step being trained (set by the policy actor's fit)
        self.div_last_good: Optional[str] = None  # the checkpoint `latest` names (for error messages)
        self.log_z_head = self.log_z_optim = None
        self._ensure_log_z_head()

    def _ensure_log_z_head(self) -> None:
        """FlowRL (``needs.prompt_hidden``): a small log Z head outside DeepSpeed, own AdamW."""
        if not self.div_method.needs.prompt_hidden or self.log_z_head is not None:
            return
        model = self.actor.model.module if hasattr(self.actor.model, "module") else self.actor.model
        device = next(model.parameters()).device
        torch.manual_seed(int(getattr(self.args.train, "seed", 0)))
        self.log_z_head = make_log_z_head(self.div_method.hparams.get("log_z_head", "small_detached"),
                                          model.config.hidden_size).to(device)
        lr = getattr(getattr(self.args, "div", None), "log_z_lr", None)
        if lr is None:
            lr = self.args.actor.adam.lr
        self.log_z_optim = torch.optim.AdamW(self.log_z_head.parameters(), lr=float(lr))

    def ppo_train(self, kl_ctl: float):
        """OpenRLHF's epoch loop, with online and anchor tokens normalised separately; under
        aggregation ``micro-batch-token-mean`` its micro-batches are the authors' layout
        (:func:`~.loss.authors_micro_batches`) instead of its shuffled, gas-sized windows."""

        def per_step_norms(data_iter, strategy, accumulated_gradient, mask_fn):
            if uses_authors_layout(self.div_method):
                return self._authors_micro_batches(strategy)
            return split_window_norms(
                data_iter, strategy, accumulated_gradient, mask_fn,
                lambda e: anchor_rows(e.info, e.action_mask.shape[0], e.action_mask.device))

        with _swapped(_ppo_actor, "iter_grad_accum_global_norm", per_step_norms):
            return super().ppo_train(kl_ctl)

    def _authors_micro_batches(self, strategy):
        """One epoch of the authors' layout over this replica's rows (OpenRLHF's shuffled
        DataLoader is not read). Every rank must plan the same number of micro-batches per step
        (DeepSpeed's collectives): a mismatch is an error, not a hang."""
        import torch.distributed as dist

        items = list(self.replay_buffer.items)
        dp = 1
        group = None
        if dist.is_available() and dist.is_initialized():
            group = strategy.ds_device_mesh["dp"].get_group() if hasattr(strategy, "ds_device_mesh") else None
            dp = dist.get_world_size(group=group)

        def sync(n: int) -> int:
            if dp <= 1:
                return n
            t = torch.tensor([n], dtype=torch.long, device=torch.cuda.current_device()
                             if torch.cuda.is_available() else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            return int(t)

        gas = int(self.actor.model.gradient_accumulation_steps()) if hasattr(
            self.actor.model, "gradient_accumulation_steps") else int(strategy.accumulated_gradient)
        world = self.div_layout.authors_world_size
        rank = 0
        if world is not None:  # the authors' layout is over the whole rollout step: every rank's rows
            items, _, rank = gather_step_rows(items, group)
        plan = list(authors_micro_batches(
            items, self.div_method, self.div_layout, mini_batch_rows=int(self.args.train.batch_size) // int(world or dp),
            gas=gas,
            collate=self.replay_buffer.collate_fn,
            anchor_fn=lambda it: float(torch.as_tensor(it.info.get(ANCHOR_FLAG, 0.0)).reshape(-1)[0]) > 0.5,
            tokens_fn=lambda it: int(it.attention_mask.sum()), sync=sync, dp_size=dp, rank=rank))
        if dp > 1:
            shape = torch.tensor([len(plan), sum(1 for _, i in plan if i[AUTHORS_KEY]["boundary"])], dtype=torch.long)
            lo, hi = shape.clone(), shape.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            if not torch.equal(lo, hi):
                raise RuntimeError(
                    f"the authors' micro-batch layout differs across data-parallel ranks ({shape.tolist()} "
                    f"micro-batches / steps here, {lo.tolist()}..{hi.tolist()} overall): the replicas got "
                    "unequal rollout or anchor rows; make --rollout.batch_size x n_samples_per_prompt and "
                    "--div.anchor_batch_size multiples of the data-parallel size")
        return iter(plan)

    def training_step(self, experience: Experience, kl_ctl: float, step: int,
                      loss_batch_info: Optional[Dict] = None) -> Dict:
        self.actor.train()
        method = self.div_method
        needs = method.needs
        B = experience.action_mask.shape[0]
        device = experience.action_mask.device
        is_anchor = anchor_rows(experience.info, B, device)
        correct = correct_rows(experience.info, B, method, device)
        if loss_batch_info is None:  # OpenRLHF's dynamic-batch path (no anchors: see check_supported)
            online_mask, _ = split_masks(experience.action_mask, is_anchor)
            loss_batch_info = get_loss_batch_info(
                self.strategy, online_mask, replay_buffer=self.replay_buffer, step=step,
                dynamic_batch=self.args.train.dynamic_batch_enable)

        mm_inputs = {}
        if getattr(experience, "mm_train_inputs", None) and getattr(self.actor, "is_vlm", False):
            mm_inputs = merge_mm_train_inputs(experience.mm_train_inputs, experience.sequences.device)

        if needs.prompt_hidden:
            self._ensure_log_z_head()
            mm_inputs["output_hidden_states"] = True
        log_probs, output = self.actor(
            experience.sequences, experience.action_mask, attention_mask=experience.attention_mask,
            return_output=True, ring_attn_group=self.strategy.ring_attn_group, packed_seq_lens=None,
            return_entropy=True, **mm_inputs)
        A = experience.action_mask.shape[1]
        # the policy's entropy is always logged (div/entropy, the progress line's): the fused head
        # takes it in the same pass, and without gradient when the loss does not use it
        full_entropy = output.entropy[:, -A:] if getattr(output, "entropy", None) is not None else None
        entropy = full_entropy if needs.entropy else None
        log_z = None
        if needs.prompt_hidden:
            pooled = mean_prompt_hidden(output.hidden_states[-1], experience.attention_mask, experience.action_mask)
            log_z = self.log_z_head(pooled)

        loss, metrics = div_actor_loss(
            method, log_probs=log_probs, action_mask=experience.action_mask, is_anchor=is_anchor,
            old_log_probs=experience.action_log_probs, advantages=experience.advantages,
            ref_log_probs=experience.base_action_log_probs, entropy=entropy, correct=correct,
            loss_batch_info=loss_batch_info, generator=self._div_generator, log_z=log_z)
        policy_loss = loss.detach()
        if full_entropy is not None and "div/entropy" not in metrics:
            online, _ = split_masks(experience.action_mask, is_anchor)
            m = online.float()
            metrics = dict(metrics)
            metrics["div/entropy"] = float((full_entropy.detach().float() * m).sum() / m.sum().clamp_min(1.0))
        if self.aux_loss:  # Mixtral-style router balancing, as OpenRLHF adds it
            aux = output.aux_loss * self.args.actor.aux_loss_coef
            if self.args.train.dynamic_batch_enable:
                aux = aux * self.replay_buffer.dynamic_sample_loss_scale[step]
            loss = loss + aux
        self.last_loss = loss.detach()
        # a non-finite loss stops the job here, before backward: no update, nothing checkpointed
        check_finite_scalar(self.last_loss, "loss", self.div_step, self.div_last_good)

        authors = (loss_batch_info or {}).get(AUTHORS_KEY)
        if authors is not None and hasattr(self.actor.model, "set_gradient_accumulation_boundary"):
            # the authors' steps have as many micro-batches as the layout gives (a quarter-size
            # anchor step, token budgets): the step ends where the layout says, not every gas
            self.actor.model.set_gradient_accumulation_boundary(bool(authors["boundary"]))
        self.strategy.backward(loss, self.actor, self.actor_optim)
        optimizer_step = (not self.args.train.dynamic_batch_enable
                          or self.replay_buffer.dynamic_optimizer_step[step])
        boundary = self._ds_boundary() if optimizer_step else False
        if optimizer_step:
            self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler, name="actor")
            if boundary:  # DeepSpeed computed the step's global norm: a non-finite one stops the job
                check_finite_scalar(self.strategy.get_grad_norm(self.actor), "gradient norm", self.div_step,
                                    self.div_last_good)
            if self.log_z_head is not None and boundary:
                self._log_z_step()
            if self.ema_model:
                self.strategy.moving_average(self.actor, self.ema_model, self.ema_beta, "cuda")

        return self._status(experience, policy_loss, metrics, is_anchor, optimizer_step)

    def _ds_boundary(self) -> bool:
        """Whether the coming DeepSpeed ``step()`` applies the update (gradient-accumulation boundary)."""
        engine = self.actor.model
        fn = getattr(engine, "is_gradient_accumulation_boundary", None)
        return bool(fn()) if fn is not None else True

    def _log_z_step(self) -> None:
        """Step FlowRL's head with DeepSpeed's semantics: gradients averaged over the
        data-parallel ranks (``aggregate_loss`` multiplied the loss by ``dp_size`` for exactly
        that average), then AdamW, then zeroed."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = self.strategy.ds_device_mesh["dp"].get_group()
            n = dist.get_world_size(group=group)
            for p in self.log_z_head.parameters():  # every rank joins, even without online rows
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
                p.grad.div_(n)
        self.log_z_optim.step()
        self.log_z_optim.zero_grad(set_to_none=True)

    def _status(self, experience, policy_loss, metrics, is_anchor, optimizer_step) -> Dict:
        """Metrics in the shape OpenRLHF's ``ppo_train`` reduces: 0-d tensors are
        token-weighted, ``[B]`` tensors sample-weighted, ``None`` weights are kept as is."""
        out = {"policy_loss": policy_loss}
        weights = {"policy_loss": "token"}
        for k, v in metrics.items():
            out[k] = torch.tensor(float(v))
            weights[k] = "token"
        out["div/anchor_frac"] = is_anchor.float()
        weights["div/anchor_frac"] = "sample"
        out["actor_lr"] = self.actor_scheduler.get_last_lr()[0]
        weights["actor_lr"] = None
        if optimizer_step:
            out["actor_grad_norm"] = self.strategy.get_grad_norm(self.actor)
            weights["actor_grad_norm"] = None
        B = experience.action_mask.shape[0]
        for k, v in (experience.info or {}).items():
            if k in out:
                continue
            if isinstance(v, torch.Tensor):
                out[k], weights[k] = v, ("token" if v.dim() == 0 else "sample")
            elif isinstance(v, list) and len(v) == B:
                out[k], weights[k] = row_values(experience.info, k, B), "sample"
        return {
            "metrics": out,
            "weights": weights,
            "num_samples": float(B),
            "num_action_tokens": float(experience.action_mask.sum().item()),
        }


def _build_ray_actor_classes():
    import ray

    class _DivPolicyModelActor(PolicyModelActor.__ray_actor_class__):
        """``PolicyModelActor`` that trains with :class:`DivActorPPOTrainer`; its model (and EMA model)
        is a :class:`~.logprob_actor.HiddenLogProbActor` (log-probs without ``[tokens, V]`` logits)."""

        def init_model_from_pretrained(self, strategy, *args, **kwargs):
            from .logprob_actor import HiddenLogProbActor

            upstream_load = strategy.load_ckpt

            def load_ckpt(model, load_dir, tag=None, **kw):
                # the checkpoint `latest` names, verified; a damaged one is named and skipped
                if tag is None:
                    tag = resolve_resume_tag(load_dir, rank0=strategy.is_rank_0())
                    if tag is None:
                        return upstream_load(model, load_dir, tag=None, **kw)
                    strategy.print(f"[openrlhf-div] loading checkpoint {os.path.join(load_dir, tag)}")
                return upstream_load(model, load_dir, tag=tag, **kw)

            strategy.load_ckpt = load_ckpt
            try:
                with _swapped(_ppo_actor, "ActorPPOTrainer", DivActorPPOTrainer), \
                        _swapped(_ppo_actor, "Actor", HiddenLogProbActor):
                    out = super().init_model_from_pretrained(strategy, *args, **kwargs)
            finally:
                strategy.load_ckpt = upstream_load
            self._div_step = int((self.checkpoint_states or {}).get("global_step", 0) or 0)
            return out

        def _ckpt_dir(self) -> str:
            return os.path.join(self.strategy.args.ckpt.path, "_actor")

        def fit(self, kl_ctl: float = 0):
            # the controller calls fit once per rollout step: count them for the guards' messages
            self._div_step = getattr(self, "_div_step", 0) + 1
            self.trainer.div_step = self._div_step
            latest = read_latest(self._ckpt_dir())
            self.trainer.div_last_good = os.path.join(self._ckpt_dir(), latest) if latest else None
            return super().fit(kl_ctl)

        def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
            """Upstream's save with openrlhf-div's order (see .checkpoints): non-finite weights
            refused, manifest, then ``latest``, then rotation; a failed write named."""
            args = self.strategy.args
            if self.disable_ds_ckpt or not TAG_RE.match(str(tag)):
                return super().save_checkpoint(tag, client_states, metric_value, metric_key)
            from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

            client_states = client_states or {}
            step = int(client_states.get("global_step", getattr(self, "_div_step", 0)))
            save_actor_checkpoint(
                self.strategy, self.actor.model, self._ckpt_dir(), tag, max_num=args.ckpt.max_num,
                max_mem=args.ckpt.max_mem, client_state=client_states, metric_value=metric_value,
                metric_key=metric_key, step=step, params=list(self.actor.model.parameters()),
                barrier=torch_dist_barrier_and_cuda_sync)
            if self.save_hf_ckpt:
                self.strategy.save_model(self.ema_model if args.train.enable_ema else self.actor, self.tokenizer,
                                         os.path.join(args.ckpt.path, f"{tag}_hf"))
            torch_dist_barrier_and_cuda_sync()

    _DivPolicyModelActor.__module__ = __name__
    _DivPolicyModelActor.__qualname__ = "_DivPolicyModelActor"
    return {"_DivPolicyModelActor": _DivPolicyModelActor,
            "DivPolicyModelActor": ray.remote(num_gpus=1)(_DivPolicyModelActor)}


def __getattr__(name: str):
    """``_DivPolicyModelActor`` / ``DivPolicyModelActor``, built (and ``ray`` imported) on first use."""
    if name in ("_DivPolicyModelActor", "DivPolicyModelActor"):
        globals().update(_build_ray_actor_classes())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
