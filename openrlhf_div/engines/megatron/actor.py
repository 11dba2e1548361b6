"""Ray actors for the Megatron backend: a drop-in for OpenRLHF's policy (and reference) actor.

``MegatronPolicyActor`` exposes exactly the methods OpenRLHF 0.11.2's controller calls on the
policy ``RayActorGroup`` (``trainer/ppo_trainer.py``, ``ppo_utils/experience_maker.py``,
``ray/launcher.py``)::

    __init__(world_size, rank, master_addr, master_port)   RayActorGroup._initiate_actors
    get_master_addr_port()                                 RayActorGroup (rank 0)
    init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
    execute_batch(method_name, all_data, start, end)       async_run_method_batch ("forward", "append")
    forward(sequences, action_mask, attention_mask, ...)   old log-probs, [B, A] on CPU
    append(experience)                                     replay buffer
    fit(kl_ctl=0) -> dict                                  one PPO pass over the buffer
    broadcast_to_vllm()                                    weight sync (NCCL group or CUDA IPC)
    save_model()                                           HF checkpoint in --ckpt.output_dir
    save_checkpoint(tag, client_states, metric_value, metric_key)
    get_checkpoint_states() -> dict                        client state of the loaded checkpoint
    offload_states() / reload_states()                     colocation (--ds.enable_sleep path)
    empty_cache()

``MegatronReferenceActor`` has the reference subset (``init_model_from_pretrained(strategy,
pretrain)``, ``forward``, ``empty_cache``, ``execute_batch``).

Rows and the method registry. ``fit`` flattens the appended experiences into rows, shuffles them
with a seed shared by the replica's ranks, and cuts optimiser steps of ``--train.batch_size /
dp`` rows made of micro-batches of ``--train.micro_batch_size`` rows. A row is a ``D_pef``
anchor row when the experience marks it (:mod:`openrlhf_div.engines.contract`); every loss comes from
the registry method through :func:`.loss.registry_loss`, with the step's global token counts. Under
aggregation ``micro-batch-token-mean`` (the DPH-RL authors' update loop) the rows are not shuffled:
:func:`authors_steps` lays them out with the run's micro-batch layout (:class:`~..layout.EngineLayout`,
the planner call site shared with the OpenRLHF actor: rollouts, then anchors; steps of
``--train.batch_size / dp`` rows; the method's ``micro_batch_seqs`` rows or
``--layout.micro_batch_tokens`` budgets per micro-batch, each with its ``authors_coef``).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from openrlhf_div.algorithms.authors import share_micro_batches
from openrlhf_div.algorithms.registry import Method, method_from_spec
from openrlhf_div.compat.flash_attn_standin import install as _install_flash_attn_standin

from ..contract import gather_step_rows, rows_from_experience
from ..layout import EngineLayout, uses_authors_layout
from .config import MegatronConfig, megatron_config_from_args
from .loss import MicroBatch, step_counts

# Ray unpickles this actor's arguments (OpenRLHF's strategy -> openrlhf.models -> flash_attn)
# after importing this module: without flash-attn (CPU) the stand-in must already be there.
_install_flash_attn_standin()  # no-op where flash-attn is installed

logger = logging.getLogger(__name__)

__all__ = ["MegatronPolicyActor", "MegatronReferenceActor", "resolve_method", "collate_rows"]

# ---------------------------------------------------------------------- method from args
def resolve_method(args) -> Method:
    """The registry method of a run, exactly as the DeepSpeed path builds it.

    Uses the ``--div.*`` flags' ``method_from_args`` (:mod:`openrlhf_div.engines.flags`, shared by
    the OpenRLHF driver and this actor: ``--div.method`` + every ``--div.<hparam>``); with
    ``args.div.hparams`` set, ``args.div.method`` (a :class:`Method` or a name) with those
    overrides (a dict or ``["key=value", ...]``, YAML-parsed values).
    """
    div = getattr(args, "div", None)
    m = getattr(div, "method", None) if div is not None else None
    if isinstance(m, Method):
        return m
    if getattr(div, "hparams", None) is None:
        from ..flags import method_from_args

        return method_from_args(args)
    if not m:
        raise ValueError("the Megatron actor needs the method: set --div.method (see `openrlhf-div methods`)")
    from openrlhf_div.plugins import load_plugins

    load_plugins()  # OPENRLHF_DIV_PLUGINS: a method registered outside the package
    overrides = getattr(div, "hparams", None) or {}
    if isinstance(overrides, (list, tuple)):  # key=value items, read by the one config loader
        from openrlhf_div.config import parse_overrides

        overrides = parse_overrides(overrides, example="anchor_eta=0.1")
    return method_from_spec({"name": str(m), "hparams": dict(overrides)})  # once per process


# ---------------------------------------------------------------------- experience -> rows
def collate_rows(rows: List[Dict[str, torch.Tensor]], pad_token_id: int = 0) -> MicroBatch:
    """Right-pad rows to the longest and stack them into a :class:`MicroBatch` (``A = L - 1``)."""
    L = max(int(r["sequences"].shape[0]) for r in rows)
    B = len(rows)
    seq = torch.full((B, L), pad_token_id, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.long)
    tok: Dict[str, torch.Tensor] = {}
    for i, r in enumerate(rows):
        n = int(r["sequences"].shape[0])
        seq[i, :n] = r["sequences"]
        am[i, :n] = r["attention_mask"]
        for k in ("action_mask", "old_log_probs", "advantages", "ref_log_probs", "anchor_ref_log_probs"):
            if any(k in q for q in rows):
                t = tok.setdefault(k, torch.zeros(B, L - 1))
                if k in r:
                    t[i, : n - 1] = r[k]
    kw: Dict[str, Any] = dict(sequences=seq, attention_mask=am, **tok)
    if all("correct" in r for r in rows):
        kw["correct"] = torch.stack([r["correct"] for r in rows])
    if any("is_anchor" in r for r in rows):
        kw["is_anchor"] = torch.stack([r.get("is_anchor", torch.tensor(False)) for r in rows])
    return MicroBatch(**kw)


def authors_steps(rows: List[Dict[str, torch.Tensor]], method: Method, mini_batch_rows: int, pad_token_id: int = 0,
                  sync=None, layout: Optional[EngineLayout] = None, dp_size: int = 1,
                  rank: int = 0) -> List[List[MicroBatch]]:
    """One replica's optimiser steps in the authors' layout (:meth:`EngineLayout.plan`, the run's
    ``layout:`` settings; rows in replay order, rollouts before anchors, no shuffle), each
    micro-batch carrying its ``authors_coef`` (and ``authors_ppo_anchors``). With
    ``layout.authors_world_size`` ``rows`` are the whole rollout step (every replica's, gathered),
    ``mini_batch_rows`` the authors' rows per GPU and step, and this replica (``rank`` of
    ``dp_size``) keeps its share of each step
    (:func:`~openrlhf_div.algorithms.authors.share_micro_batches`; padding shares weigh 0)."""
    layout = layout or EngineLayout()
    world = layout.authors_world_size
    plan = layout.plan(method, [bool(r.get("is_anchor", False)) for r in rows],
                       [int(r["attention_mask"].sum()) for r in rows],
                       mini_batch_rows=int(mini_batch_rows), sync=sync)
    steps = []
    for step in plan:
        if world is not None:
            share = share_micro_batches(step, dp_size, rank)
            step = [p if p is not None else replace(step[0], coef=0.0, ppo_anchors=()) for p in share]
        batches = []
        for pmb in step:
            mb = collate_rows([rows[i] for i in pmb.rows], pad_token_id)
            mb.authors_coef = pmb.coef
            if pmb.ppo_anchors:
                routed = set(pmb.ppo_anchors)
                mb.authors_ppo_anchors = torch.tensor([i in routed for i in pmb.rows], dtype=torch.bool)
            batches.append(mb)
        steps.append(batches)
    return steps


# ---------------------------------------------------------------------- actors
class _DistributedActor:
    """Rank bookkeeping of a Ray actor in a torch.distributed group (as OpenRLHF's actors)."""

    def __init__(self, world_size: int, rank: int, master_addr: Optional[str], master_port: Optional[int]):
        logging.basicConfig(format="%(asctime)s %(levelname)-8s %(message)s", level=logging.INFO)
        self._world_size, self._rank = world_size, rank
        self._master_addr = master_addr or self._node_ip()
        self._master_port = master_port or self._free_port()
        os.environ.update(MASTER_ADDR=self._master_addr, MASTER_PORT=str(self._master_port),
                          WORLD_SIZE=str(world_size), RANK=str(rank))
        local = "0"
        try:
            import ray
            from openrlhf.trainer.ray.utils import ray_noset_visible_devices

            if ray_noset_visible_devices():
                local = str(ray.get_gpu_ids()[0])
        except Exception:  # no Ray / no OpenRLHF (tests): Ray pins one visible GPU per actor
            pass
        os.environ["LOCAL_RANK"] = local

    @staticmethod
    def _node_ip() -> str:
        try:
            import ray

            return ray._private.services.get_node_ip_address().strip("[]")
        except Exception:
            return "127.0.0.1"

    @staticmethod
    def _free_port() -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def get_master_addr_port(self):
        return self._master_addr, self._master_port

    def is_rank_0(self) -> bool:
        return self._rank == 0

    def empty_cache(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.synchronize()

    def execute_batch(self, method_name: str, all_data: Dict[str, list], start_idx: int, end_idx: int):
        """Call ``method_name(**item)`` for each item of the chunk (OpenRLHF's batched dispatch)."""
        kwargs = {k: v[start_idx:end_idx] for k, v in all_data.items()}
        n = len(next(iter(kwargs.values())))
        for k, v in kwargs.items():
            if len(v) != n:
                raise ValueError(f"execute_batch: {k} has {len(v)} items, expected {n}")
        fn = getattr(self, method_name)
        return [fn(**{k: v[i] for k, v in kwargs.items()}) for i in range(n)]

    def _engine_args(self, strategy):
        from .engine import init_megatron_parallel

        args = strategy.args
        mcfg = megatron_config_from_args(args)
        ds = getattr(args, "ds", None)
        if ds is not None and getattr(ds, "ring_attn_size", 1) != 1:
            raise ValueError("--ds.ring_attn_size > 1 (ring attention) is a DeepSpeed-actor option; the Megatron "
                             "actor does not support context parallelism")
        if ds is not None and getattr(ds, "packing_samples", False):
            raise ValueError("--ds.packing_samples is not supported by the Megatron actor (it pads micro-batches)")
        init_megatron_parallel(mcfg, seed=int(getattr(args.train, "seed", 42)))
        return args, mcfg


class MegatronPolicyActor(_DistributedActor):
    """The trainable policy; see the module docstring for the method list."""

    def init_model_from_pretrained(self, strategy, pretrain: str, max_steps: Optional[int] = None,
                                   vllm_engines=None):
        from .engine import MegatronEngine, OptimSettings

        self.strategy = strategy
        args, mcfg = self._engine_args(strategy)
        self.args, self.mcfg = args, mcfg
        self.method = resolve_method(args)
        self.layout = EngineLayout.from_args(args)
        self.engine = MegatronEngine(mcfg, pretrain=pretrain, train=True, optim=OptimSettings.from_args(args, max_steps),
                                     method=self.method, temperature=float(args.rollout.temperature))
        self.vllm_engines = vllm_engines
        self.tokenizer = None
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(pretrain, trust_remote_code=True)
        except Exception as e:  # a weights-only directory: HF exports then carry no tokenizer
            logger.warning("no tokenizer loaded from %s (%s)", pretrain, e)
        self.pad_token_id = int(getattr(self.tokenizer, "pad_token_id", None) or 0)
        self.replay: List[Any] = []
        self._fits = 0
        self.checkpoint_states: Dict[str, Any] = {}
        ckpt = os.path.join(args.ckpt.path, "_actor")
        if getattr(args.ckpt, "load_enable", False) and os.path.exists(os.path.join(ckpt, "latest")):
            self.checkpoint_states = self.engine.load_checkpoint(ckpt)
            self._fits = int(self.checkpoint_states.get("global_step", 0))
        self._init_vllm_sync()
        # as OpenRLHF's DeepSpeed actor (trainer/ray/ppo_actor.py:581): free the training state
        # before the first vLLM wake-up; forward and weight export work while offloaded
        if getattr(getattr(args, "ds", None), "enable_sleep", False):
            self.engine.offload()

    # -------------------------------------------------------------- rollouts side
    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None):
        if mm_train_inputs_list and any(x for x in mm_train_inputs_list):
            raise ValueError("the Megatron actor is text-only (no multimodal inputs)")
        lp, _ = self.engine.forward_log_probs(sequences, attention_mask, action_mask)
        return lp

    def append(self, experience) -> None:
        self.replay.append(experience)

    # -------------------------------------------------------------- training
    def _steps(self):
        rows = [r for exp in self.replay for r in rows_from_experience(exp, self.method)]
        if not rows:
            return []
        dp = self.engine.dp_size
        if uses_authors_layout(self.method):
            group = self.engine.dp_group if dp > 1 else None

            def sync(n: int) -> int:
                if group is None:
                    return n
                t = torch.tensor([n], dtype=torch.long, device=self.engine.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                return int(t)

            world = self.layout.authors_world_size
            rank = 0
            if world is not None and group is not None:  # the authors' layout spans every replica's rows
                rows, _, rank = gather_step_rows(rows, group)
            return authors_steps(rows, self.method, int(self.args.train.batch_size) // int(world or dp),
                                 self.pad_token_id, sync, self.layout, dp_size=dp, rank=rank)
        g = torch.Generator().manual_seed(int(getattr(self.args.train, "seed", 42)) + self._fits)
        order = torch.randperm(len(rows), generator=g).tolist()
        rows = [rows[i] for i in order]
        mbs = int(self.args.train.micro_batch_size)
        per_step = max(mbs, int(self.args.train.batch_size) // dp)
        steps = []
        for s in range(0, len(rows), per_step):
            chunk = rows[s: s + per_step]
            steps.append([collate_rows(chunk[m: m + mbs], self.pad_token_id) for m in range(0, len(chunk), mbs)])
        return steps

    def fit(self, kl_ctl: float = 0) -> Dict[str, float]:
        """PPO epochs over the replay buffer; returns the step-averaged metrics (``kl_ctl`` is
        OpenRLHF's KL controller value: the registry method carries its own KL weight)."""
        self.empty_cache()
        steps = self._steps()
        # every rank must run the same number of steps (collectives inside); replicas normally get
        # equal shares, a trailing remainder on some replicas is dropped (and logged)
        n = torch.tensor([len(steps)], dtype=torch.long, device=self.engine.device)
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        if int(n) < len(steps):
            logger.warning("dropping %d trailing optimiser step(s): data-parallel replicas got unequal rows",
                           len(steps) - int(n))
            steps = steps[: int(n)]
        dp_group = self.engine.dp_group if self.engine.dp_size > 1 else None
        history = []
        for _ in range(int(self.args.train.max_epochs)):
            for batches in steps:
                history.append(self.engine.train_step(batches, step_counts(batches, dp_group)))
        self.replay.clear()
        self._fits += 1
        self.empty_cache()
        return _status(_mean_metrics(history))

    # -------------------------------------------------------------- weights -> vLLM
    def _init_vllm_sync(self):
        args = self.args
        backend = getattr(args.vllm, "sync_backend", "nccl")
        self.use_cuda_ipc = (backend == "nccl" and getattr(args.train, "colocate_all", False)
                             and not getattr(args.train, "async_enable", False))
        self._model_update_group = None
        if self.vllm_engines and not self.use_cuda_ipc and dist.get_rank() == 0:
            import ray

            addr = ray._private.services.get_node_ip_address()
            port = self._free_port()
            tp = int(args.vllm.tensor_parallel_size)
            world = len(self.vllm_engines) * tp + 1
            use_ray = getattr(args.vllm, "sync_with_ray", False)
            refs = [e.init_process_group.remote(addr, port, i * tp + 1, world, "openrlhf", backend=backend,
                                                use_ray=use_ray) for i, e in enumerate(self.vllm_engines)]
            if use_ray:
                import ray.util.collective as collective

                collective.init_collective_group(world_size=world, rank=0, backend=backend, group_name="openrlhf")
                self._model_update_group = "openrlhf"
            else:
                from openrlhf.utils.distributed_util import stateless_init_process_group

                self._model_update_group = stateless_init_process_group(addr, port, 0, world,
                                                                        torch.cuda.current_device())
            ray.get(refs)
        dist.barrier()

    def broadcast_to_vllm(self):
        """Send the weights in Hugging Face layout to every vLLM engine, one tensor at a time
        (each gathered over TP / PP from the resident parameters; valid while offloaded)."""
        import ray

        if not self.vllm_engines:
            return
        if self.use_cuda_ipc and self.mcfg.pp > 1:
            raise ValueError("CUDA-IPC weight sync (colocate_all) needs --megatron.pp 1")
        resets = []
        if getattr(self.args.vllm, "enable_prefix_caching", False) and dist.get_rank() == 0:
            resets = [e.reset_prefix_cache.remote() for e in self.vllm_engines]
        self.empty_cache()
        # CUDA IPC: every rank hands over its own copy; NCCL: one replica gathers, rank 0 sends
        if self.use_cuda_ipc or self.engine.dp_rank == 0:
            for (name, t), last in _with_last(self.engine.iter_hf_weights(all_ranks=self.use_cuda_ipc)):
                self._send_weight(name, t, last)
        if resets:
            ray.get(resets)
        self.empty_cache()
        dist.barrier()

    def _send_weight(self, name: str, t: torch.Tensor, last: bool) -> None:
        """Hand one full HF tensor to the vLLM engines (CUDA IPC when colocated, else the
        model-update group from global rank 0)."""
        if self.use_cuda_ipc:
            self._send_cuda_ipc(name, t, last)
        elif dist.get_rank() == 0:
            self._send_broadcast(name, t, last)

    def _send_broadcast(self, name: str, t: torch.Tensor, last: bool) -> None:
        import ray

        t = t.contiguous()
        refs = [e.update_weight.remote(name, dtype=t.dtype, shape=t.shape, empty_cache=last)
                for e in self.vllm_engines]
        if getattr(self.args.vllm, "sync_with_ray", False):
            import ray.util.collective as collective

            collective.broadcast(t, 0, group_name=self._model_update_group)
        else:
            self._model_update_group.broadcast(t, src=0, stream=torch.cuda.current_stream())
        ray.get(refs)

    def _send_cuda_ipc(self, name: str, t: torch.Tensor, last: bool) -> None:
        import ray
        from openrlhf.trainer.ray.utils import get_physical_gpu_id
        from torch.multiprocessing.reductions import reduce_tensor

        weight = t.detach().clone().contiguous()
        handles: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(handles, {get_physical_gpu_id(): reduce_tensor(weight)})
        if dist.get_rank() == 0:
            merged = {}
            for h in handles:
                merged.update(h)
            ray.get([e.update_weight_cuda_ipc.remote(name, dtype=weight.dtype, shape=weight.shape,
                                                     ipc_handles=merged, empty_cache=last)
                     for e in self.vllm_engines])
        dist.barrier()
        torch.cuda.synchronize()

    # -------------------------------------------------------------- checkpoints
    def save_model(self):
        self.engine.save_hf(self.args.ckpt.output_dir, tokenizer=self.tokenizer)

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        args = self.args
        if not getattr(args.ckpt, "disable_ds", False):
            self.engine.save_checkpoint(os.path.join(args.ckpt.path, "_actor"), tag, client_states or {},
                                        max_num=int(getattr(args.ckpt, "max_num", 3) or 0))
        if getattr(args.ckpt, "save_hf", False):
            self.engine.save_hf(os.path.join(args.ckpt.path, f"{tag}_hf"), tokenizer=self.tokenizer)
        dist.barrier()

    def get_checkpoint_states(self):
        return self.checkpoint_states

    # -------------------------------------------------------------- colocation
    def offload_states(self):
        self.engine.offload()

    def reload_states(self):
        self.engine.reload()


class MegatronReferenceActor(_DistributedActor):
    """Frozen reference model for methods with ``needs.ref_log_probs`` (same layout as the policy)."""

    def init_model_from_pretrained(self, strategy, pretrain: str):
        from .engine import MegatronEngine

        self.strategy = strategy
        args, mcfg = self._engine_args(strategy)
        self.engine = MegatronEngine(mcfg, pretrain=pretrain, train=False,
                                     temperature=float(args.rollout.temperature))

    def forward(self, sequences, action_mask=None, attention_mask=None, return_output=False,
                packed_seq_lens=None, mm_train_inputs_list=None):
        lp, _ = self.engine.forward_log_probs(sequences, attention_mask, action_mask)
        return lp


# ---------------------------------------------------------------------- helpers
def _with_last(it):
    """``(item, is_last)`` pairs (one-item lookahead)."""
    it = iter(it)
    try:
        prev = next(it)
    except StopIteration:
        return
    for cur in it:
        yield prev, False
        prev = cur
    yield prev, True


def _status(m: Dict[str, float]) -> Dict[str, float]:
    """Metric names as the DeepSpeed path logs them: registry metrics under ``div/``, plus
    OpenRLHF's ``policy_loss`` / ``actor_lr`` / ``actor_grad_norm``."""
    out = {}
    for k, v in m.items():
        out[k if k in ("actor_lr", "actor_grad_norm") else f"div/{k}"] = v
    if "loss" in m:
        out["policy_loss"] = m["loss"]
    return out


def _mean_metrics(history: List[Dict[str, float]]) -> Dict[str, float]:
    """Mean over optimiser steps; learning rate and grad norm: the last step's (as OpenRLHF)."""
    if not history:
        return {}
    out: Dict[str, float] = {}
    keys = set().union(*history)
    for k in keys:
        vals = [h[k] for h in history if k in h]
        out[k] = vals[-1] if k in ("actor_lr", "actor_grad_norm") else sum(vals) / len(vals)
    return out
