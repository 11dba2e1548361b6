"""The Megatron-core training engine behind the Ray actors: one instance per GPU (rank).

``MegatronEngine`` owns one rank's ``GPTModel`` stage, its Megatron DDP wrapper, optimiser
(optionally Megatron's distributed optimiser) and LR scheduler, and offers what the actor needs:

* :meth:`forward_log_probs`: old (or reference) log-probs ``[B, A]`` of a batch, no gradient;
* :meth:`train_step`: one optimiser step over a list of :class:`~.loss.MicroBatch` (gradient
  accumulation through Megatron's pipeline schedule), loss from the method registry via
  :func:`~.loss.registry_loss` with the step's global token counts;
* :meth:`save_checkpoint` / :meth:`load_checkpoint`: Megatron distributed checkpoints (model +
  optimiser, resharding-capable) plus scheduler state and the caller's client state;
* :meth:`iter_hf_weights`: the weights in Hugging Face layout, gathered over TP / PP, for vLLM
  weight sync and HF checkpoints.

Input layout. OpenRLHF hands over ``sequences`` / ``attention_mask`` ``[B, L]`` (right-padded in
0.11.2, left-padded elsewhere) and an ``action_mask`` ``[B, A]`` aligned with the last ``A`` of the
``L - 1`` next-token targets. Megatron's RoPE numbers positions ``0..s-1`` for every row and its
attention is purely causal, so each row is rotated left by its number of leading pads (real
tokens start at position 0, as Hugging Face's ``position_ids = cumsum(mask) - 1`` gives), and
trailing pads (never attended to by real tokens under a causal mask) stay. The per-token
outputs are mapped back to the original columns. With sequence parallelism the length is padded
to a multiple of TP.

Parallel layout. ``initialize_model_parallel(..., order="tp-cp-ep-pp-dp")``: the ``tp * pp``
ranks of one model replica are consecutive global ranks, which is how OpenRLHF's
``RayActorGroup(duplicate_actors=tp*pp)`` hands one data chunk to each replica.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from openrlhf_div.algorithms.registry import Method

from .config import MegatronConfig
from .loss import ADDITIVE_METRICS, MicroBatch, StepCounts, loss_scale, registry_loss, step_counts
from .vocab_parallel import output_layer_returns_hidden, output_weight, vocab_parallel_log_probs_from_hidden
from .weights import GPTLayout, hf_to_megatron_param, megatron_param_to_hf, merge_tp_shards
from openrlhf_div.io import atomic_write_text

logger = logging.getLogger(__name__)

__all__ = ["OptimSettings", "MegatronEngine", "init_megatron_parallel", "hf_tensor_getter", "optimizer_config"]

SCHEDULES = {"cosine_with_min_lr": "cosine", "cosine": "cosine", "constant": "constant",
             "constant_with_warmup": "constant", "linear": "linear"}


@dataclass
class OptimSettings:
    """Optimiser and LR schedule (OpenRLHF's ``--actor.adam.*``, ``--actor.lr_*``, ``--actor.max_norm``)."""

    optimizer: str = "adam"               # adam (AdamW) | sgd (tests: update = -lr * grad)
    lr: float = 1e-6
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_norm: float = 1.0
    lr_scheduler: str = "cosine_with_min_lr"
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1
    max_steps: int = 1000

    @classmethod
    def from_args(cls, args, max_steps: Optional[int]) -> "OptimSettings":
        a = args.actor
        if getattr(a, "optim", "adam") != "adam":
            raise ValueError(f"--actor.optim {a.optim!r} is not supported by the Megatron actor (adam only)")
        return cls(lr=float(a.adam.lr), betas=tuple(a.adam.betas), eps=float(a.adam.eps),
                   weight_decay=float(a.adam.weight_decay), max_norm=float(a.max_norm),
                   lr_scheduler=str(a.lr_scheduler), warmup_ratio=float(a.lr_warmup_ratio),
                   min_lr_ratio=float(a.min_lr_ratio), max_steps=int(max_steps or 1))


def optimizer_config(mcfg: MegatronConfig, o: OptimSettings):
    """megatron-core's ``OptimizerConfig`` for the actor.

    The host optimizer (``--megatron.optimizer_cpu_offload``) is megatron-core's
    ``HybridDeviceOptimizer`` behind the distributed optimizer, *with*
    ``use_precision_aware_optimizer`` as megatron-core expects it: the distributed optimizer then
    hands its bf16 parameter shards to the hybrid optimizer, which keeps the fp32 master copy,
    Adam's moments and a pinned fp32 gradient copy on the host. Without the flag the distributed
    optimizer also keeps fp32 main-parameter shards on the GPU (4 bytes per parameter and
    data-parallel rank: ~15 GiB per GPU for the 32B model at TP 8) that the host optimizer then
    copies again into pinned host memory.
    """
    from megatron.core.optimizer import OptimizerConfig

    host = bool(mcfg.optimizer_cpu_offload)
    if host and o.optimizer != "adam":
        raise ValueError("--megatron.optimizer_cpu_offload needs Adam (megatron-core's host optimizer is AdamW)")
    if host:
        from megatron.core.utils import get_te_version

        if get_te_version() is None:   # OptimizerConfig checks TE's version for the precision-aware optimizer
            raise RuntimeError("--megatron.optimizer_cpu_offload needs transformer_engine (megatron-core 0.16's "
                               "precision-aware optimizer checks its version); install it (the GPU image has it) "
                               "or keep the optimizer on the GPU")
    return OptimizerConfig(
        optimizer=o.optimizer, lr=o.lr, min_lr=o.lr * o.min_lr_ratio, weight_decay=o.weight_decay,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=o.max_norm,
        bf16=mcfg.bf16, params_dtype=torch.bfloat16 if mcfg.bf16 else torch.float32,
        sgd_momentum=0.0, use_distributed_optimizer=mcfg.distributed_optimizer,
        optimizer_cpu_offload=host, use_precision_aware_optimizer=host,
        main_params_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
        optimizer_offload_fraction=mcfg.optimizer_offload_fraction if host else 0.0)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_megatron_parallel(mcfg: MegatronConfig, seed: int = 42, timeout_minutes: int = 30) -> None:
    """Initialise ``torch.distributed`` (NCCL, or gloo without CUDA) and Megatron's parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        from datetime import timedelta
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo",
                                timeout=timedelta(minutes=timeout_minutes))
    world = dist.get_world_size()
    mcfg.validate(world)
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size() != mcfg.tp
                or ps.get_pipeline_model_parallel_world_size() != mcfg.pp):
            raise RuntimeError("Megatron parallel state is already initialised with a different tp/pp")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=mcfg.tp, pipeline_model_parallel_size=mcfg.pp,
                                     order="tp-cp-ep-pp-dp", distributed_timeout_minutes=timeout_minutes)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def hf_tensor_getter(path: str):
    """``name -> tensor`` over a Hugging Face checkpoint directory (safetensors, lazily opened)."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        weight_map = None
    else:
        raise FileNotFoundError(
            f"{path} holds neither model.safetensors nor model.safetensors.index.json; the Megatron actor "
            "loads safetensors checkpoints (convert .bin checkpoints with transformers' save_pretrained)"
        )
    handles: Dict[str, Any] = {}

    def get(name: str) -> torch.Tensor:
        fname = "model.safetensors" if weight_map is None else weight_map.get(name)
        if fname is None:
            raise KeyError(f"{name} is not in {index}")
        if fname not in handles:
            handles[fname] = safe_open(os.path.join(path, fname), framework="pt", device="cpu")
        return handles[fname].get_tensor(name)

    return get


class MegatronEngine:
    """One rank of a Megatron-core policy (``train=True``) or reference (``train=False``) model.

    Build with a Hugging Face checkpoint directory (``pretrain``) or, in tests, with a
    ``transformers`` config plus a state dict / getter (``hf_config`` + ``hf_weights``).
    ``init_megatron_parallel`` must have run (the actor does it).
    """

    def __init__(self, mcfg: MegatronConfig, *, pretrain: Optional[str] = None, hf_config=None,
                 hf_weights=None, train: bool = True, optim: Optional[OptimSettings] = None,
                 method: Optional[Method] = None, temperature: float = 1.0):
        from megatron.core import parallel_state as ps

        from openrlhf_div.compat.cuda_arch import fix_arch_env

        fix_arch_env(who="openrlhf-div")  # a DeepSpeed op JIT-built in this process must parse it
        self.mcfg = mcfg
        self.train_mode = train
        self.method = method
        self.temperature = float(temperature)
        if hf_config is None:
            if pretrain is None:
                raise ValueError("MegatronEngine needs pretrain (a HF checkpoint dir) or hf_config + hf_weights")
            from transformers import AutoConfig
            hf_config = AutoConfig.from_pretrained(pretrain)
        self.hf_config = hf_config
        self.layout = GPTLayout.from_hf_config(hf_config, tp_size=mcfg.tp, vocab_divisor=mcfg.vocab_divisor)
        if method is not None and method.needs.prompt_hidden:
            raise ValueError(f"method {method.name!r} needs prompt hidden states (FlowRL's log Z head), which the "
                             "Megatron actor does not provide; use the DeepSpeed actor")
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.is_first_stage = ps.is_pipeline_first_stage(ignore_virtual=True)
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.device = _device()

        self._build(pretrain, hf_weights, optim)

    # ------------------------------------------------------------------ construction
    def _build(self, pretrain, hf_weights, optim):
        from .model import build_gpt_model, stage_layer_map, uses_te_names

        mcfg = self.mcfg
        gpt = build_gpt_model(self.layout, mcfg)
        self.layer_map = stage_layer_map(gpt)
        self.te_names = uses_te_names(gpt)
        self._load_hf(gpt, pretrain, hf_weights)
        module = gpt
        if mcfg.bf16:
            from megatron.core.transformer.module import Float16Module
            module = Float16Module(gpt.config, gpt)
        self.config = gpt.config
        self.gpt = gpt
        self.optimizer = self.scheduler = None
        if not self.train_mode:
            self.model = module
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
            return
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=mcfg.grad_reduce_in_fp32, overlap_grad_reduce=mcfg.overlap_grad_reduce,
            overlap_param_gather=mcfg.overlap_param_gather, use_distributed_optimizer=mcfg.distributed_optimizer,
            check_for_nan_in_grad=False)
        self.model = DistributedDataParallel(config=gpt.config, ddp_config=ddp_cfg, module=module)
        o = optim or OptimSettings()
        if o.lr_scheduler not in SCHEDULES:
            raise ValueError(f"--actor.lr_scheduler {o.lr_scheduler!r} is not supported by the Megatron actor; "
                             f"use one of {sorted(SCHEDULES)}")
        self.optimizer = get_megatron_optimizer(optimizer_config(mcfg, o), [self.model])
        warm = int(math.ceil(o.max_steps * o.warmup_ratio))
        style = SCHEDULES[o.lr_scheduler]
        min_lr = o.lr * o.min_lr_ratio if style != "constant" else o.lr
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warm > 0 else o.lr, max_lr=o.lr, min_lr=min_lr,
            lr_warmup_steps=warm, lr_decay_steps=max(o.max_steps, warm + 1), lr_decay_style=style,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=max(o.max_steps, 1),
            wd_incr_style="constant")
        cfg = gpt.config
        cfg.no_sync_func = self.model.no_sync
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.grad_scale_func = self.optimizer.scale_loss
        if mcfg.overlap_grad_reduce:
            cfg.grad_sync_func = self.model.start_grad_sync
        if mcfg.overlap_param_gather and mcfg.distributed_optimizer:
            cfg.param_sync_func = self.model.start_param_sync

    def _load_hf(self, gpt, pretrain, hf_weights):
        use_bridge = self.mcfg.weights == "bridge" or (self.mcfg.weights == "auto" and hf_weights is None
                                                       and _bridge_available())
        if use_bridge:
            from .bridge import load_hf_with_bridge
            load_hf_with_bridge(gpt, pretrain)
            self.weights_path = "bridge"
            return
        src = hf_weights if hf_weights is not None else hf_tensor_getter(pretrain)
        own = {n: p for n, p in gpt.state_dict(keep_vars=True).items() if not n.endswith("_extra_state")}
        with torch.no_grad():
            for name, param in own.items():
                shard = hf_to_megatron_param(name, src, self.layout, self.mcfg.tp, self.tp_rank, self.layer_map,
                                             self.te_names)
                if shard.shape != param.shape:
                    raise ValueError(f"{name}: mapped shard {tuple(shard.shape)} != parameter {tuple(param.shape)}")
                param.data.copy_(shard.to(param.dtype))
        self.weights_path = "builtin"

    # ------------------------------------------------------------------ inputs / outputs
    def _prepare(self, mb: MicroBatch):
        """Left-pad-free token ids ``[B, L']`` and the per-row shifts (see the module docstring)."""
        seq = mb.sequences
        am = mb.attention_mask.to(seq.device)
        B, L = seq.shape
        lefts = (am.long().cumsum(dim=1) == 0).sum(dim=1)  # leading pads per row
        if bool((lefts > 0).any()):
            idx = (torch.arange(L, device=seq.device)[None, :] + lefts[:, None]) % L
            ids = seq.gather(1, idx)
        else:
            ids = seq
        Lp = L
        if self.mcfg.sp:
            Lp = int(math.ceil(L / self.mcfg.tp) * self.mcfg.tp)
            if Lp > L:
                ids = torch.cat([ids, ids.new_zeros(B, Lp - L)], dim=1)
        pos = torch.arange(Lp, device=seq.device)[None, :].expand(B, Lp)
        return ids.to(self.device), pos.to(self.device), lefts

    def _log_probs_entropy(self, hidden: torch.Tensor, mb: MicroBatch, lefts: torch.Tensor, need_entropy: bool):
        """``[B, A]`` log-probs (and entropies) from the last hidden states ``[B, L', H]`` and this
        rank's output-layer rows (never the ``[B, L', V/tp]`` logits, see :mod:`.vocab_parallel`)."""
        weight = output_weight(self.gpt)
        hidden = hidden.to(weight.dtype)  # Float16Module hands the last stage's output back in fp32
        seq = mb.sequences.to(hidden.device)
        B, L = seq.shape
        A = mb.num_actions
        amask = mb.action_mask.to(hidden.device)
        has = amask.sum(dim=0) > 0
        j0 = int(torch.nonzero(has)[0]) if bool(has.any()) else A - 1   # first column any row trains on
        cols = torch.arange(L - 1 - A + j0, L - 1, device=hidden.device)       # predicting positions
        lefts = lefts.to(hidden.device)
        if bool((lefts > 0).any()):
            src = (cols[None, :] - lefts[:, None]).clamp(min=0)
            pred = hidden.gather(1, src[..., None].expand(B, src.shape[1], hidden.shape[-1]))
        else:
            pred = hidden[:, L - 1 - A + j0: L - 1]
        target = seq[:, L - A + j0:]
        per = self.layout.padded_vocab_size // self.mcfg.tp
        lp, h = vocab_parallel_log_probs_from_hidden(pred, weight, target, vocab_start=self.tp_rank * per,
                                                     vocab_size=self.layout.vocab_size, temperature=self.temperature,
                                                     group=self.tp_group if self.mcfg.tp > 1 else None,
                                                     need_entropy=need_entropy)
        if j0 > 0:
            lp = torch.cat([lp.new_zeros(B, j0), lp], dim=1)
            if h is not None:
                h = torch.cat([h.new_zeros(B, j0), h], dim=1)
        return lp, h

    def _run(self, batches: Sequence[MicroBatch], forward_only: bool, loss_fn) -> List[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
        it = iter(batches)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids, pos, lefts = self._prepare(mb)
            with output_layer_returns_hidden(self.gpt):  # last stage: hidden states [B, L', H], no logits
                out = model(ids, pos, None)
            return out, partial(loss_fn, mb, lefts)

        max_len = max(int(mb.sequences.shape[1]) for mb in batches)
        max_b = max(int(mb.sequences.shape[0]) for mb in batches)
        return fb(forward_step_func=forward_step, data_iterator=it, model=[self.model],
                  num_microbatches=len(batches), seq_length=max_len, micro_batch_size=max_b,
                  forward_only=forward_only)

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def forward_log_probs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor,
                          need_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[B, A]`` log-probs (times ``action_mask``, as OpenRLHF's actor) on CPU, on every rank."""
        mb = MicroBatch(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask)
        B, A = action_mask.shape

        def loss_fn(mb_, lefts, output):
            lp, h = self._log_probs_entropy(output, mb_, lefts, need_entropy)
            return output.new_zeros(()), {"lp": lp.float(), "h": None if h is None else h.float()}

        was_training = self.model.training
        self.model.eval()
        out = self._run([mb], forward_only=True, loss_fn=loss_fn)
        if was_training:
            self.model.train()
        if self.is_last_stage:
            lp = out[0]["lp"]
            h = out[0]["h"] if need_entropy else None
        else:
            lp = torch.zeros(B, A, dtype=torch.float32, device=self.device)
            h = torch.zeros(B, A, dtype=torch.float32, device=self.device) if need_entropy else None
        if self.mcfg.pp > 1:  # hand the last stage's result to the whole replica
            src = dist.get_global_rank(self.pp_group, self.mcfg.pp - 1)
            dist.broadcast(lp, src=src, group=self.pp_group)
            if h is not None:
                dist.broadcast(h, src=src, group=self.pp_group)
        am = action_mask.to(lp.device, lp.dtype)
        return (lp * am).cpu(), (None if h is None else (h * am).cpu())

    def train_step(self, batches: Sequence[MicroBatch], counts: Optional[StepCounts] = None,
                   generator: Optional[torch.Generator] = None) -> Dict[str, float]:
        """One optimiser step over ``batches`` (one replica's share); returns reduced metrics.

        ``counts`` defaults to :func:`step_counts` all-reduced over the data-parallel group.
        """
        if not self.train_mode:
            raise RuntimeError("train_step on a reference (train=False) engine")
        if self.method is None:
            raise RuntimeError("MegatronEngine.train_step needs a registry method (method=...)")
        if not batches:
            raise ValueError("train_step got no micro-batches")
        need_entropy = self.method.needs.entropy
        scale = loss_scale(batches, self.dp_size)
        if counts is None:
            counts = step_counts(batches, self.dp_group if self.dp_size > 1 else None)

        def loss_fn(mb, lefts, output):
            dev = output.device
            mb_dev = _to_device(mb, dev)
            lp, h = self._log_probs_entropy(output, mb_dev, lefts, need_entropy)
            loss, metrics, weights = registry_loss(self.method, lp, h, mb_dev, counts, generator=generator)
            return loss * scale, {"metrics": metrics, "weights": weights}

        with self._training_state():
            self.model.train()
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            outs = self._run(batches, forward_only=False, loss_fn=loss_fn)
            ok, grad_norm, _ = self.optimizer.step()
            if ok:
                self.scheduler.step(increment=1)
        local = _reduce_microbatch_metrics(outs) if (self.is_last_stage and self.tp_rank == 0) else {}
        metrics = _allreduce_metrics(local)
        try:
            metrics["actor_lr"] = float(self.optimizer.param_groups[0]["lr"])
        except (AttributeError, IndexError, KeyError, TypeError):
            metrics["actor_lr"] = float("nan")
        metrics["actor_grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_successful"] = float(bool(ok))
        return metrics

    # ------------------------------------------------------------------ colocation
    @property
    def offloaded(self) -> bool:
        return getattr(self, "_offloader", None) is not None and self._offloader.offloaded

    def offload(self) -> int:
        """Release the optimiser state (to pinned host memory) and the gradient buffers from the
        device; the parameters stay (see :mod:`.offload` for why). Returns the bytes freed; a
        no-op for a reference engine or when already offloaded."""
        from .offload import StorageOffloader, training_state_tensors

        if not self.train_mode or self.offloaded:
            return 0
        # rebuilt every time: torch's optimisers create their state lazily at the first step
        self._offloader = StorageOffloader(*training_state_tensors(self.model, self.optimizer))
        freed = self._offloader.offload()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    def reload(self) -> None:
        if self.offloaded:
            self._offloader.reload()

    @contextlib.contextmanager
    def _training_state(self):
        """The optimiser state and gradient buffers on the device for the block (reloaded and
        offloaded again when the caller had offloaded them)."""
        was = self.offloaded
        self.reload()
        try:
            yield
        finally:
            if was:
                self.offload()

    # ------------------------------------------------------------------ HF export
    def iter_hf_weights(self, *, all_ranks: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` in the parameters' dtype, gathered over TP and PP.

        Collective over the replica's TP and PP groups: every rank of the replica must iterate
        it to the end. Tensors are yielded on every rank of pipeline stage 0 (``all_ranks``: on
        every rank of the replica); other ranks see an empty iteration. Uses megatron-bridge's
        exporter when the weights were loaded with it.
        """
        if self.weights_path == "bridge":
            from .bridge import export_hf_with_bridge
            yield from export_hf_with_bridge(self.gpt)
            return
        own = [(n, p) for n, p in self.gpt.state_dict(keep_vars=True).items() if not n.endswith("_extra_state")]
        # every stage learns every stage's (name, merged shape, dtype) list
        meta_local = []
        for n, p in own:
            shape = list(p.shape)
            kind_dim = _merge_dim(n, self.layer_map, self.te_names)
            if kind_dim is not None:
                shape[kind_dim] *= self.mcfg.tp
            meta_local.append((n, shape, str(p.dtype).replace("torch.", ""), dict(self.layer_map)))
        metas = [meta_local]
        if self.mcfg.pp > 1:
            metas = [None] * self.mcfg.pp
            dist.all_gather_object(metas, meta_local, group=self.pp_group)
        for stage, meta in enumerate(metas):
            mine = stage == self.pp_rank
            params = dict(own) if mine else {}
            for name, shape, dtype, layer_map in meta:
                layer_map = {int(k): v for k, v in layer_map.items()}
                full = None
                if mine:
                    p = params[name].detach()
                    shards = [p]
                    if self.mcfg.tp > 1:
                        shards = [torch.empty_like(p) for _ in range(self.mcfg.tp)]
                        dist.all_gather(shards, p.contiguous(), group=self.tp_group)
                    full = merge_tp_shards(name, shards, layer_map, self.te_names)
                if self.mcfg.pp > 1:
                    if full is None:
                        full = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                    dist.broadcast(full, src=dist.get_global_rank(self.pp_group, stage), group=self.pp_group)
                if self.pp_rank == 0 or all_ranks:
                    for hf_name, t in megatron_param_to_hf(name, full, self.layout, layer_map, self.te_names):
                        yield hf_name, t

    def hf_state_dict(self) -> Dict[str, torch.Tensor]:
        """All HF weights on CPU (small models / tests; use :meth:`iter_hf_weights` at scale)."""
        return {n: t.detach().cpu().clone() for n, t in self.iter_hf_weights()}

    def save_hf(self, out_dir: str, tokenizer=None, max_shard_bytes: int = 4 << 30) -> None:
        """Write a Hugging Face checkpoint (sharded safetensors + config [+ tokenizer]) from global rank 0."""
        from .hf_io import ShardedSafetensorsWriter

        writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes) if dist.get_rank() == 0 else None
        for name, t in self.iter_hf_weights():
            if writer is not None:
                writer.add(name, t)
        if writer is not None:
            writer.close(config=self.hf_config, tokenizer=tokenizer)
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def _sharded_state_dict(self, is_loading: bool) -> dict:
        """Model (+ optimiser) as megatron-core ``ShardedTensor``s in TP/PP-independent global
        coordinates; the distributed optimiser's state in its ``fully_reshardable`` form."""
        sd = {"model": self.gpt.sharded_state_dict()}
        if self.optimizer is not None:
            sd["optimizer"] = self.optimizer.sharded_state_dict(
                sd["model"], is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        return sd

    def save_checkpoint(self, ckpt_dir: str, tag: str, client_state: Optional[dict] = None,
                        max_num: Optional[int] = None) -> str:
        """Save model, optimiser, scheduler and the caller's client state under ``ckpt_dir/tag``.

        Model and optimiser go through ``megatron.core.dist_checkpointing`` (every rank writes its
        shards in parallel; the checkpoint is stored in global coordinates, so it resumes under
        another TP / PP / DP layout); ``extra.pt`` holds the scheduler, the client state
        (OpenRLHF's episode / global step / data-loader position) and the saving layout.
        ``ckpt_dir/latest`` names the newest tag and is written last, atomically; with
        ``max_num`` older tags beyond it are deleted. Works while offloaded (OpenRLHF saves after
        ``offload_states``): the optimiser state is brought back for the save.
        """
        from megatron.core import dist_checkpointing

        path = os.path.join(ckpt_dir, tag)
        with self._training_state():
            if dist.get_rank() == 0:
                if os.path.exists(path):
                    shutil.rmtree(path)
                os.makedirs(path, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(self._sharded_state_dict(is_loading=False), path)
            if dist.get_rank() == 0:
                extra = {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                         "client_state": client_state or {}, "mcfg": self.mcfg.to_dict(),
                         "rng": torch.get_rng_state()}
                _atomic_torch_save(extra, os.path.join(path, "extra.pt"))
                atomic_write_text(os.path.join(ckpt_dir, "latest"), tag)
                if max_num:
                    _rotate(ckpt_dir, keep=max_num, current=tag)
            dist.barrier()
        return path

    def load_checkpoint(self, ckpt_dir: str, tag: Optional[str] = None) -> dict:
        """Restore model, optimiser and scheduler from ``ckpt_dir/tag`` (default: ``latest``),
        saved under any TP / PP layout with the same padded vocabulary (see
        :func:`.weights.padded_vocab_size`); returns the saved client state."""
        from megatron.core import dist_checkpointing

        if tag is None:
            with open(os.path.join(ckpt_dir, "latest")) as f:
                tag = f.read().strip()
        path = os.path.join(ckpt_dir, tag)
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "extra.pt")):
            raise FileNotFoundError(f"no Megatron checkpoint at {path} (no extra.pt)")
        extra = torch.load(os.path.join(path, "extra.pt"), weights_only=False)
        with self._training_state():
            if self.optimizer is not None:
                self._prime_optimizer_state()
            loaded = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), path)
            self.gpt.load_state_dict(loaded["model"])
            if self.optimizer is not None:
                _load_optimizer_state(self.optimizer, loaded["optimizer"])
            if self.scheduler is not None and extra.get("scheduler") is not None:
                self.scheduler.load_state_dict(extra["scheduler"])
            dist.barrier()
        return extra.get("client_state", {})

    def _prime_optimizer_state(self) -> None:
        """Give a fresh optimiser its state tensors (and step counter) before loading into them.

        A never-stepped torch Adam holds no state, and megatron-core's optimiser state dict then
        misses ``step`` and the moments. One step with zero gradients and learning rate 0 creates
        them without changing any weight; the checkpoint then overwrites them.
        """
        if self.optimizer is None or self.scheduler is None or self.scheduler.num_steps > 0:
            return
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for p in self.model.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr


# ---------------------------------------------------------------------- helpers
def _bridge_available() -> bool:
    try:
        import megatron.bridge  # noqa: F401
    except Exception:
        return False
    return True


def _merge_dim(name: str, layer_map, te_names) -> Optional[int]:
    from .weights import _lookup

    kind, _ = _lookup(name, layer_map, te_names)
    return {"vocab": 0, "qkv": 0, "fc1": 0, "col_split": 1}.get(kind)


def _to_device(mb: MicroBatch, dev) -> MicroBatch:
    kw = {}
    for k, v in vars(mb).items():
        kw[k] = v.to(dev) if isinstance(v, torch.Tensor) else v
    return MicroBatch(**kw)


def _reduce_microbatch_metrics(outs: List[dict]) -> Dict[str, Tuple[float, float]]:
    """``{name: (weighted sum, weight)}``; additive metrics get weight 0 (summed as they are)."""
    acc: Dict[str, List[float]] = {}
    for o in outs:
        for k, v in o["metrics"].items():
            w = o["weights"].get(k)
            s = acc.setdefault(k, [0.0, 0.0])
            if w is None:
                s[0] += float(v)
            else:
                s[0] += float(v) * float(w)
                s[1] += float(w)
    return {k: (v[0], v[1]) for k, v in acc.items()}


def _allreduce_metrics(local: Dict[str, Tuple[float, float]]) -> Dict[str, float]:
    """Combine the per-replica metric sums of all ranks (only contributing ranks have entries)."""
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    tot: Dict[str, List[float]] = {}
    for d in gathered:
        for k, (s, w) in (d or {}).items():
            t = tot.setdefault(k, [0.0, 0.0])
            t[0] += s
            t[1] += w
    out = {}
    for k, (s, w) in tot.items():
        out[k] = s if k in ADDITIVE_METRICS else (s / w if w > 0 else 0.0)
    return out


def _load_optimizer_state(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` for a dist-checkpointing state dict, working around
    megatron-core 0.16 with torch's Adam (no Transformer Engine / Apex: CPU, or a GPU image
    without them). There the distributed optimiser (1) hands every parameter the *same* ``step``
    tensor, which torch's Adam then increments in place once per parameter (17 parameters: step
    1 -> 18 after one step, wrong bias correction), and (2) fails loading the parameter state on
    the per-parameter ``step`` it skips itself (``KeyError: 'step'``). The parameter state is
    therefore loaded with the steps hidden, and each parameter gets its own copy back. With TE's
    FusedAdam (no per-parameter ``step``) this is exactly ``load_state_dict``.
    """
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    param_state = state.get("param_state") if len(opts) == 1 else None
    if param_state is None or state.get("param_state_sharding_type") != "fully_reshardable":
        optimizer.load_state_dict(state)
        return
    opt = opts[0]
    opt.load_state_dict({k: v for k, v in state.items() if k not in ("param_state", "param_state_sharding_type")})
    inner = getattr(opt, "optimizer", None)
    saved = []
    for st in (getattr(inner, "state", {}) or {}).values():
        if isinstance(st, dict) and "step" in st:
            saved.append((st, st.pop("step")))
    try:
        opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for st, step in saved:
            st["step"] = step.clone() if torch.is_tensor(step) else step


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _rotate(ckpt_dir: str, keep: int, current: str) -> None:
    tags = [d for d in os.listdir(ckpt_dir) if os.path.isdir(os.path.join(ckpt_dir, d))
            and os.path.exists(os.path.join(ckpt_dir, d, "extra.pt"))]
    tags.sort(key=lambda d: os.path.getmtime(os.path.join(ckpt_dir, d, "extra.pt")))
    for d in tags[:-keep] if keep > 0 else []:
        if d != current:
            shutil.rmtree(os.path.join(ckpt_dir, d), ignore_errors=True)
