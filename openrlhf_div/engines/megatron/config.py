"""The ``--megatron.*`` flag group and :class:`MegatronConfig`.

Users select the backend with ``--div.actor_backend megatron`` and size it with these flags, for
example ``--megatron.tp 8 --megatron.pp 1 --megatron.sp --megatron.recompute full``. Everything
else (vLLM, rewards, the method registry, anchor batches) keeps its usual flags; the optimiser
reads OpenRLHF's ``--actor.adam.*``, ``--actor.lr_*``, ``--actor.max_norm`` and the batch sizes
``--train.batch_size`` / ``--train.micro_batch_size``.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

__all__ = ["MegatronConfig", "add_megatron_arguments", "megatron_config_from_args"]

RECOMPUTE = ("none", "selective", "full")
IMPLS = ("auto", "transformer_engine", "local")
WEIGHT_PATHS = ("auto", "bridge", "builtin")


@dataclass
class MegatronConfig:
    """Parallel layout and memory options of the Megatron actor (one per flag)."""

    tp: int = 1                            # tensor-parallel size (heads, MLP width, vocabulary split)
    pp: int = 1                            # pipeline-parallel size (layers split into stages)
    sp: bool = False                       # sequence parallel: norms/dropout activations split over TP
    distributed_optimizer: bool = True     # shard fp32 master weights + Adam state over data-parallel ranks
    optimizer_cpu_offload: bool = False    # fp32 master weights + Adam state (and the step) on the host
    optimizer_offload_fraction: float = 1.0  # share of the optimiser state offloaded (with the flag above)
    recompute: str = "none"                # activation recomputation: none | selective (attention) | full
    recompute_method: str = "uniform"      # full recompute: uniform | block
    recompute_num_layers: int = 1          # full recompute: layers per recomputed chunk (uniform)
    vocab_divisor: int = 128               # vocabulary padded to a multiple of vocab_divisor * tp
    bf16: bool = True                      # bf16 parameters/activations with fp32 master weights
    grad_reduce_in_fp32: bool = True       # accumulate and all-reduce gradients in fp32
    overlap_grad_reduce: bool = False      # overlap the DP gradient reduce-scatter with backward
    overlap_param_gather: bool = False     # overlap the distributed optimizer's all-gather with forward
    transformer_impl: str = "auto"         # auto (TE when installed and on CUDA) | transformer_engine | local
    weights: str = "auto"                  # HF conversion: auto (megatron-bridge when installed) | bridge | builtin

    def validate(self, world_size: Optional[int] = None) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"--megatron.tp and --megatron.pp must be >= 1, got {self.tp}, {self.pp}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--megatron.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"--megatron.recompute_method must be uniform or block, got {self.recompute_method!r}")
        if self.transformer_impl not in IMPLS:
            raise ValueError(f"--megatron.transformer_impl must be one of {IMPLS}, got {self.transformer_impl!r}")
        if self.weights not in WEIGHT_PATHS:
            raise ValueError(f"--megatron.weights must be one of {WEIGHT_PATHS}, got {self.weights!r}")
        if self.optimizer_cpu_offload and not self.distributed_optimizer:
            raise ValueError("--megatron.optimizer_cpu_offload needs the distributed optimizer "
                             "(drop --megatron.no_distributed_optimizer)")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(f"--megatron.optimizer_offload_fraction must be in [0, 1], got {self.optimizer_offload_fraction}")
        if self.sp and self.tp == 1:
            raise ValueError("--megatron.sp (sequence parallel) needs --megatron.tp > 1")
        if world_size is not None and world_size % (self.tp * self.pp):
            raise ValueError(
                f"the actor group has {world_size} GPUs, not a multiple of tp * pp = {self.tp * self.pp}; "
                "set --actor.num_nodes * --actor.num_gpus_per_node to a multiple of it"
            )

    @property
    def model_parallel_size(self) -> int:
        """GPUs per model replica (``tp * pp``): OpenRLHF's ``duplicate_actors`` for this backend."""
        return self.tp * self.pp

    def data_parallel_size(self, world_size: int) -> int:
        self.validate(world_size)
        return world_size // self.model_parallel_size

    def to_dict(self) -> dict:
        return asdict(self)


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--megatron.*`` group (dotted flags, OpenRLHF style; ``args.megatron.tp`` after
    OpenRLHF's ``hierarchize``) and ``--div.actor_backend`` when the parser lacks it."""
    d = MegatronConfig()
    if "--div.actor_backend" not in parser._option_string_actions:   # unless the driver defines it
        parser.add_argument("--div.actor_backend", choices=("deepspeed", "megatron"), default="deepspeed",
                            help="policy (and reference) actor: OpenRLHF's DeepSpeed actor or the Megatron-core one")
    g = parser.add_argument_group("megatron", "Megatron-core actor (with --div.actor_backend megatron)")
    g.add_argument("--megatron.tp", type=int, default=d.tp, help="tensor-parallel size")
    g.add_argument("--megatron.pp", type=int, default=d.pp, help="pipeline-parallel size")
    g.add_argument("--megatron.sp", action="store_true", default=d.sp, help="sequence parallel (needs tp > 1)")
    g.add_argument("--megatron.no_distributed_optimizer", dest="megatron.distributed_optimizer",
                   action="store_false", default=d.distributed_optimizer,
                   help="keep full fp32 master weights and Adam state on every data-parallel rank")
    g.add_argument("--megatron.optimizer_cpu_offload", action="store_true", default=d.optimizer_cpu_offload,
                   help="keep fp32 master weights and Adam state on the host and step there (HybridDeviceOptimizer)")
    g.add_argument("--megatron.optimizer_offload_fraction", type=float, default=d.optimizer_offload_fraction,
                   help="fraction of the optimiser state offloaded with --megatron.optimizer_cpu_offload")
    g.add_argument("--megatron.recompute", choices=RECOMPUTE, default=d.recompute,
                   help="activation recomputation: selective (core attention) or full (whole layers)")
    g.add_argument("--megatron.recompute_method", choices=("uniform", "block"), default=d.recompute_method)
    g.add_argument("--megatron.recompute_num_layers", type=int, default=d.recompute_num_layers)
    g.add_argument("--megatron.vocab_divisor", type=int, default=d.vocab_divisor,
                   help="pad the vocabulary to a multiple of vocab_divisor * tp")
    g.add_argument("--megatron.fp32", dest="megatron.bf16", action="store_false", default=d.bf16,
                   help="train in fp32 instead of bf16 (tests, debugging)")
    g.add_argument("--megatron.no_grad_reduce_in_fp32", dest="megatron.grad_reduce_in_fp32",
                   action="store_false", default=d.grad_reduce_in_fp32)
    g.add_argument("--megatron.overlap_grad_reduce", action="store_true", default=d.overlap_grad_reduce)
    g.add_argument("--megatron.overlap_param_gather", action="store_true", default=d.overlap_param_gather)
    g.add_argument("--megatron.transformer_impl", choices=IMPLS, default=d.transformer_impl)
    g.add_argument("--megatron.weights", choices=WEIGHT_PATHS, default=d.weights,
                   help="Hugging Face conversion: megatron-bridge (auto when installed) or the built-in mapping")
    return parser


def megatron_config_from_args(args: Any) -> MegatronConfig:
    """Read ``args.megatron`` (nested namespace or dict; missing fields keep their defaults)."""
    ns = getattr(args, "megatron", None)
    if ns is None:
        # flat namespace (before hierarchize): "megatron.tp" attributes
        src = {f.name: getattr(args, f"megatron.{f.name}") for f in fields(MegatronConfig)
               if hasattr(args, f"megatron.{f.name}")}
    elif isinstance(ns, dict):
        src = dict(ns)
    else:
        src = dict(vars(ns))
    known = {f.name for f in fields(MegatronConfig)}
    unknown = sorted(set(src) - known)
    if unknown:
        raise ValueError(f"unknown --megatron.* options {unknown}; known: {sorted(known)}")
    cfg = MegatronConfig(**src)
    cfg.validate()
    return cfg


def warmup_steps(max_steps: int, ratio: float) -> int:
    return int(math.ceil(max_steps * ratio))
