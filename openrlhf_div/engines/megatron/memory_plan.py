"""Memory plan of a colocated Megatron actor layout for Qwen2.5-32B, on paper (a planning tool).

    openrlhf-div plan-memory --config configs/megatron/X.yaml     # one config's plan
    openrlhf-div plan-memory --markdown                           # docs/scaling_megatron.md tables
    openrlhf-div plan-memory --megatron.tp 8 --dp 2 [--cpu_offload] ...    # any layout (--tp: the same)

It counts what megatron-core 0.16, the engine's offload (``engines/megatron/offload.py``) and
vLLM's sleep mode actually allocate, per GPU and per node, in the three phases of a colocated
step (OpenRLHF's order: generate -> old log-probs -> reload/fit/offload -> weight sync).
``tests/test_megatron_configs.py`` checks that every ``configs/megatron/*.yaml`` states the
figures this model gives (its ``cluster.plan_*`` keys). Bytes, with ``P`` the parameters of this
GPU's model shard and ``P_s = P / dp`` the distributed optimiser's shard of it:

GPU, actor during ``fit`` (:func:`estimate_memory`)

* weights ``2P`` (bf16); gradient buffer ``4P`` (fp32, ``grad_reduce_in_fp32``) or ``2P``;
* optimiser on the GPU: fp32 main params + Adam ``m``, ``v`` = ``12 P_s``; with the host
  optimiser (``--megatron.optimizer_cpu_offload``, offload fraction ``f``) ``12 (1 - f) P_s`` --
  as megatron-core expects it, with ``use_precision_aware_optimizer``; without that flag the
  distributed optimiser would still keep fp32 main-param shards on the GPU, ``+4 f P_s``
  (``precision_aware=False`` shows that variant);
* activations: what one layer keeps for backward (:func:`layer_activation_bytes`), which depends
  on the attention implementation the config runs (:func:`attention_impl`): megatron-core's
  *local* layer spec (no Transformer Engine: unfused ``DotProductAttention``, torch norms) keeps
  the ``[b, a/tp, s, s]`` score matrices (the fp32 softmax output and its bf16 copy), the causal
  mask and q/k/v expanded to every head; the *TE* spec (flash / cuDNN attention, norms fused into
  the linears) keeps no ``s^2`` term. The local figures were counted on this CPU from the tensors
  autograd saves in one layer of the real local spec (``tests/test_memory_plan_measured.py``);
  the TE figures are derived, not yet measured. No recomputation: every layer of the stage
  (x ``pp`` micro-batches in flight); full recomputation: each layer's input ``2 s b h`` (/ tp
  with sequence parallelism) per layer, plus one layer recomputed in backward; selective
  (core attention): the local spec's ``s^2`` terms are recomputed. Plus the backward's transient
  gradient of the score matrices (local: two fp32 ``[b, a/tp, s, s]``) and the final norm / fp32
  output of the last stage;
* log-probs from hidden states: the vocabulary-parallel kernel works on token chunks of at most
  ``2^26`` fp32 logits (256 MiB), so no ``[s, V/tp]`` logits exist; counted as three chunk-sized
  buffers (logits, their exponentials, the gradient in backward);
* overhead: the actor's and the sleeping vLLM worker's CUDA contexts, NCCL buffers,
  fragmentation: 5 GiB.

GPU, generation (actor offloaded): vLLM's budget ``gpu_memory_utilization x GPU`` + the actor's
resident bf16 weights ``2P`` + its CUDA context (1 GiB). GPU, weight sync: vLLM's weights only
(``model bytes / vllm_tp``, woken with ``tags=["weights"]``) + its context + the actor's weights
and context + the largest gathered tensor three times (TP shards, merged tensor, CUDA-IPC clone).

Host (:func:`node_plan`), per GPU then times GPUs per node:

* host optimiser (megatron-core's ``HybridDeviceOptimizer``): fp32 master ``4 f P_s`` + Adam
  ``8 f P_s`` (pageable) + fp32 gradient copies ``4 f P_s`` (pinned, ``pin_cpu_grads``); without
  the precision-aware flag the fp32 master copy is pinned too;
* optimiser state on the GPU is copied to pinned host buffers while offloaded (``offload.py``):
  ``12 (1 - f) P_s`` pinned, during generation and weight sync;
* vLLM sleep (level 1) keeps each engine's weights in pinned host memory: ``model bytes`` per
  engine on the node.

Not counted: the Ray object store, dataloaders, the HF export's 4 GiB shard buffer (rank 0 only).

Measured against the card (docs/benchmarks.md, "GPU figures"): Qwen2.5-1.5B at TP = 1, local spec,
no recomputation, 4 micro-batches of 4 x 1024 tokens, no overhead: 47.59 GiB measured
(``max_memory_allocated``, one NVIDIA H200, 2026-11-28); this model: :data:`MEASURED` (the
figures before this model of the attention: 35.34 GiB, 26% low).

Model FLOPs per trained token (the MFU numerator; recomputation not counted):
``6 (L (h (h + 2gd) + h^2 + 3 h f) + V h) + 6 L h s_bar`` with ``s_bar = s / 2``;
:func:`expected_mfu` multiplies assumed efficiencies (no GPU in the CI).
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, replace
from typing import Dict, Optional

from openrlhf_div.engines.megatron.config import MegatronConfig
from openrlhf_div.engines.megatron.weights import GPTLayout, padded_vocab_size

GiB = float(1 << 30)
H100_BF16_DENSE_TFLOPS = 989.0
OVERHEAD_GIB = 5.0           # fit: CUDA contexts (actor + sleeping vLLM), NCCL buffers, fragmentation
ACTOR_CONTEXT_GIB = 1.0      # the actor's CUDA context + NCCL while vLLM runs
VLLM_CONTEXT_GIB = 1.0       # a vLLM worker's CUDA context (weight sync phase)
LOGPROB_CHUNK_FLOATS = 1 << 26   # fp32 logits per chunk of the log-prob kernel (algorithms/logprobs.py)

# Qwen2.5-32B / Qwen2.5-Coder-32B / OmniSQL-32B (config.json of the released checkpoints)
QWEN25_32B = GPTLayout(num_layers=64, hidden_size=5120, num_heads=40, num_kv_heads=8, head_dim=128,
                       ffn_hidden_size=27648, vocab_size=152064, padded_vocab_size=152064,
                       tie_embeddings=False, qkv_bias=True, norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=32768, model_type="qwen2")


def with_tp(layout: GPTLayout, tp: int, divisor: int = 128) -> GPTLayout:
    return replace(layout, padded_vocab_size=padded_vocab_size(layout.vocab_size, tp, divisor))


def layer_params(L: GPTLayout) -> int:
    h, g, d, f = L.hidden_size, L.num_kv_heads, L.head_dim, L.ffn_hidden_size
    qkv = h * (L.num_heads * d + 2 * g * d) + (L.num_heads * d + 2 * g * d if L.qkv_bias else 0)
    return qkv + L.num_heads * d * h + 3 * h * f + 2 * h


def total_params(L: GPTLayout) -> int:
    emb = L.vocab_size * L.hidden_size
    return L.num_layers * layer_params(L) + emb * (1 if L.tie_embeddings else 2) + L.hidden_size


@dataclass
class Memory:
    """Per-GPU bytes of the actor during ``fit`` plus its host-side optimiser bytes."""

    params_per_gpu: float
    weights: float
    grads: float
    optimizer: float               # fp32 main params + Adam moments left on the GPU
    main_params_gpu: float         # of which: fp32 main-param shards kept by a non-precision-aware host optimizer
    act_checkpoints: float
    act_layer: float
    logits: float
    overhead: float
    host_optimizer: float          # host: fp32 master + Adam moments
    host_pinned_grads: float       # host, pinned: fp32 gradient copies of the host optimizer
    host_pinned_master: float      # host, pinned: fp32 master copies (non-precision-aware only)

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.act_checkpoints + self.act_layer + self.logits
                + self.overhead)

    def as_gib(self) -> Dict[str, float]:
        keys = ("weights", "grads", "optimizer", "act_checkpoints", "act_layer", "logits", "overhead")
        out = {k: getattr(self, k) / GiB for k in keys}
        out["total"] = self.total / GiB
        out["host_optimizer_per_gpu"] = (self.host_optimizer + self.host_pinned_grads) / GiB
        out["params_per_gpu_B"] = self.params_per_gpu / 1e9
        return out


#: attention implementations the planner models: Transformer Engine's spec (flash / cuDNN fused
#: attention) and megatron-core's local spec (unfused attention, torch norms)
ATTENTION = ("te", "local")

#: the planner against the card: (source, layout, measured GiB); tests/test_megatron_configs.py pins it
MEASURED = [("docs/benchmarks.md, GPU figures: gpu_bench megatron case, NVIDIA H200, 2026-11-28 "
             "(../shared/gpu_runs/2026-11-28/rerun_megatron_fusedadam)",
             dict(shape="qwen2.5-1.5b", tp=1, recompute="none", attention="local", micro_batch=4, n_micro=4,
                  seq_len=1024), 47.59)]


def attention_impl(m: MegatronConfig) -> str:
    """The attention a config runs: ``local`` with ``--megatron.transformer_impl local``, else ``te``
    (``auto`` picks Transformer Engine, which the project's docker image installs; on an image
    without it, ``auto`` falls back to the local spec: plan that with ``plan-memory --attention local``)."""
    return "local" if m.transformer_impl == "local" else "te"


def layer_activation_bytes(L: GPTLayout, s: int, b: float, tp: int, sp: int, impl: str,
                           recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for backward (bf16 training), per GPU.

    ``local`` (counted on the CPU from autograd's saved tensors of megatron-core 0.16's local spec,
    tests/test_memory_plan_measured.py): two torch RMSNorms ``20 s b h`` (fp32 copies + bf16
    outputs), attention ``8 s b a d`` (q, k, v expanded to all heads, the projection's input) +
    ``6 s^2 b a`` (fp32 softmax output and its bf16 copy) + the ``s^2`` bool causal mask, SwiGLU MLP
    ``10 s b f``. ``te`` (derived): norms fused into the linears ``8 s b h`` (inputs + normalised
    outputs), flash attention q, k, v at their own head counts + its output ``2 s b (2a + 2g) d``,
    MLP ``6 s b f`` (fc1 output + activation). Selective recomputation (core attention) drops the
    ``s^2`` terms and the expanded copies (the checkpoint keeps q, k, v)."""
    if impl not in ATTENTION:
        raise ValueError(f"attention {impl!r}: one of {', '.join(ATTENTION)}")
    h, a, g, d, f = L.hidden_size, L.num_heads, L.num_kv_heads, L.head_dim, L.ffn_hidden_size
    sb = s * b
    if impl == "local":
        norms = 20 * sb * h / sp
        attn = 8 * sb * a * d / tp + 6.0 * s * s * b * a / tp + s * s
        mlp = 10 * sb * f / tp
        if recompute == "selective":
            attn = 2 * sb * (2 * a + 2 * g) * d / tp
    else:
        norms = 8 * sb * h / sp
        attn = 2 * sb * (2 * a + 2 * g) * d / tp
        mlp = 6 * sb * f / tp
    return norms + attn + mlp


def estimate_memory(L: GPTLayout, m: MegatronConfig, dp: int, seq_len: int, micro_batch: int = 1,
                    overhead_gib: float = OVERHEAD_GIB, precision_aware: bool = True,
                    attention: Optional[str] = None) -> Memory:
    """The actor's per-GPU bytes during ``fit`` on the busiest pipeline stage (module docstring);
    ``attention``: ``te`` | ``local`` (default: the config's, :func:`attention_impl`)."""
    L = with_tp(L, m.tp, m.vocab_divisor)
    tp, pp = m.tp, m.pp
    h, s, b = L.hidden_size, seq_len, micro_batch
    layers = math.ceil(L.num_layers / pp)
    emb = L.padded_vocab_size * h
    stage_emb = emb * (2 if (pp == 1 and not L.tie_embeddings) else 1)
    P = (layers * layer_params(L) + stage_emb) / tp
    weights = (2 if m.bf16 else 4) * P
    grads = (4 if (m.grad_reduce_in_fp32 or not m.bf16) else 2) * P
    shard = P / (dp if m.distributed_optimizer else 1)
    f = m.optimizer_offload_fraction if m.optimizer_cpu_offload else 0.0
    main_gpu = 4 * f * shard if (f > 0 and not precision_aware) else 0.0
    optimizer = 12 * (1 - f) * shard + main_gpu
    sp = tp if m.sp else 1
    in_flight = pp                                    # 1F1B: the first stage holds pp micro-batches
    impl = attention_impl(m) if attention is None else attention
    kept = layer_activation_bytes(L, s, b, tp, sp, impl, m.recompute)
    transient = layer_activation_bytes(L, s, b, tp, sp, impl, "none") if m.recompute == "full" else 0.0
    transient += 8.0 * s * s * b * L.num_heads / tp if impl == "local" else 0.0   # d(scores), fp32, twice
    last = (22 if impl == "local" else 14) * s * b * h / sp    # final norm + the fp32 hidden states handed back
    if m.recompute == "full":
        ckpt = 2 * s * b * h / sp * layers * in_flight
    else:
        ckpt = kept * layers * in_flight
    act_layer = transient + last
    logits = 3 * 4 * min(s * b * L.padded_vocab_size / tp, LOGPROB_CHUNK_FLOATS)
    return Memory(P, weights, grads, optimizer, main_gpu, ckpt, act_layer, logits, overhead_gib * GiB,
                  host_optimizer=12 * f * shard, host_pinned_grads=4 * f * shard,
                  host_pinned_master=0.0 if precision_aware else 4 * f * shard)


def model_bytes(L: GPTLayout) -> float:
    """bf16 weights of the whole (unpadded) model: what one vLLM engine holds and sleeps to the host."""
    return 2.0 * total_params(L)


def largest_tensor_bytes(L: GPTLayout, tp: int, divisor: int = 128) -> float:
    """The largest HF tensor gathered for weight sync, bf16 (the embedding or the MLP projection)."""
    Lp = with_tp(L, tp, divisor)
    return 2.0 * max(Lp.padded_vocab_size * L.hidden_size, 2 * L.ffn_hidden_size * L.hidden_size)


def node_plan(L: GPTLayout, m: MegatronConfig, *, dp: int, seq_len: int, gpus_per_node: int, gpu_gib: float,
              vllm_tp: int, vllm_util: float, precision_aware: bool = True, micro_batch: float = 1,
              attention: Optional[str] = None) -> Dict[str, float]:
    """Per-GPU GiB in each phase of a colocated step and per-node host GiB (module docstring)."""
    mem = estimate_memory(L, m, dp, seq_len, micro_batch=micro_batch, precision_aware=precision_aware,
                          attention=attention)
    engines_per_node = gpus_per_node / vllm_tp
    fit = mem.total
    generate = vllm_util * gpu_gib * GiB + mem.weights + ACTOR_CONTEXT_GIB * GiB
    sync = (model_bytes(L) / vllm_tp + VLLM_CONTEXT_GIB * GiB + mem.weights + ACTOR_CONTEXT_GIB * GiB
            + 3 * largest_tensor_bytes(L, m.tp, m.vocab_divisor))
    offloaded = mem.optimizer                      # GPU optimiser state -> pinned host while offloaded
    host_gpu = mem.host_optimizer + mem.host_pinned_grads + offloaded
    pinned_gpu = mem.host_pinned_grads + mem.host_pinned_master + offloaded
    vllm_host = engines_per_node * model_bytes(L)
    return {
        "params_per_gpu_B": mem.params_per_gpu / 1e9,
        "gpu_fit_gib": fit / GiB,
        "gpu_generate_gib": generate / GiB,
        "gpu_weight_sync_gib": sync / GiB,
        "gpu_peak_gib": max(fit, generate, sync) / GiB,
        "host_optimizer_per_gpu_gib": (mem.host_optimizer + mem.host_pinned_grads) / GiB,
        "host_offloaded_per_gpu_gib": offloaded / GiB,
        "host_vllm_per_node_gib": vllm_host / GiB,
        "host_per_node_gib": (gpus_per_node * host_gpu + vllm_host) / GiB,
        "pinned_host_per_node_gib": (gpus_per_node * pinned_gpu + vllm_host) / GiB,
    }


# figures a config states in its cluster section (rounded as written there)
CONFIG_KEYS = {"plan_gpu_fit_gib": ("gpu_fit_gib", 1), "plan_gpu_peak_gib": ("gpu_peak_gib", 1),
               "plan_host_gib_per_node": ("host_per_node_gib", 0),
               "plan_pinned_host_gib_per_node": ("pinned_host_per_node_gib", 0)}


def config_micro_batch(cfg: dict) -> float:
    """Sequences of ``data.max_len`` tokens per training micro-batch: ``train.micro_batch_size``,
    or under the authors' layout (``method.aggregation: micro-batch-token-mean``) its token budget
    ``layout.micro_batch_tokens / data.max_len`` (a micro-batch of that many tokens in all) or
    ``micro_batch_seqs`` rows."""
    flags = cfg["openrlhf"]
    if method_key(cfg, "aggregation") == "micro-batch-token-mean":
        tokens = (cfg.get("layout") or {}).get("micro_batch_tokens")
        return float(tokens) / float(flags["data.max_len"]) if tokens else float(method_key(cfg, "micro_batch_seqs", 2))
    return float(flags.get("train.micro_batch_size", 1))


def method_key(cfg: dict, key: str, default=None):
    """A method hyperparameter of a parsed config: its ``div:`` section or the new spelling's ``method:``."""
    for section in (cfg.get("method"), cfg.get("div")):
        if isinstance(section, dict) and section.get(key) is not None:
            return section[key]
    return default


def config_plan(cfg: dict, world_size: Optional[int] = None, attention: Optional[str] = None) -> Dict[str, float]:
    """:func:`node_plan` of a parsed ``configs/megatron/*.yaml``; ``world_size``: plan the actor
    on that many GPUs (e.g. the authors' count, ``layout.authors_world_size``: data parallel
    ``world_size / (tp x pp)``, the same per-GPU micro-batch) instead of the config's own;
    ``attention``: ``te`` | ``local`` instead of the config's (:func:`attention_impl`)."""
    flags, cluster = cfg["openrlhf"], cfg["cluster"]
    mcfg = MegatronConfig(**{k.split(".", 1)[1]: v for k, v in flags.items() if k.startswith("megatron.")})
    gpus = int(flags["actor.num_nodes"]) * int(flags["actor.num_gpus_per_node"])
    if world_size is not None:
        if int(world_size) < mcfg.model_parallel_size or int(world_size) % mcfg.model_parallel_size:
            raise ValueError(f"--world_size {world_size}: not a multiple of the config's model-parallel size "
                             f"{mcfg.model_parallel_size} (megatron.tp x megatron.pp)")
        gpus = int(world_size)
    return node_plan(QWEN25_32B, mcfg, dp=gpus // mcfg.model_parallel_size, seq_len=int(flags["data.max_len"]),
                     gpus_per_node=int(flags["actor.num_gpus_per_node"]), gpu_gib=float(cluster["gpu_mem_gb"]) * 1e9 / GiB,
                     vllm_tp=int(flags["vllm.tensor_parallel_size"]),
                     vllm_util=float(flags["vllm.gpu_memory_utilization"]), micro_batch=config_micro_batch(cfg),
                     attention=attention)


def world_size_of(cfg: dict, value) -> int:
    """``--world_size``: an integer, or ``authors`` (the config's ``layout.authors_world_size``)."""
    if str(value).strip().lower() == "authors":
        aws = (cfg.get("layout") or {}).get("authors_world_size")
        if aws is None:
            raise ValueError("--world_size authors: this config sets no layout.authors_world_size; "
                             "give a GPU count (--world_size 32)")
        return int(aws)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--world_size {value!r}: an integer GPU count or 'authors'") from None


def budget_line(cfg: dict) -> str:
    """One line on the config's token budgets: the longest row (``data.max_len`` = prompt budget +
    ``rollout.max_new_tokens``) against the micro-batch's (``layout.micro_batch_tokens``, or
    ``micro_batch_seqs`` / ``train.micro_batch_size`` rows of at most ``data.max_len``)."""
    flags = cfg["openrlhf"]
    max_len, new = int(flags["data.max_len"]), flags.get("rollout.max_new_tokens")
    prompt = max_len - int(new) if new is not None else None
    mb = config_micro_batch(cfg)
    tokens = (cfg.get("layout") or {}).get("micro_batch_tokens")
    if method_key(cfg, "aggregation") == "micro-batch-token-mean" and tokens:
        fit = "holds" if max_len <= int(tokens) else "does NOT hold"
        mb_text = f"micro-batches of {int(tokens)} tokens ({fit} the longest row)"
    else:
        mb_text = f"micro-batches of {mb:g} row{'' if mb == 1 else 's'} (at most {mb * max_len:.0f} tokens)"
    return f"prompt {prompt} + response {new} = rows of at most {max_len} tokens; {mb_text}"


def config_figures(cfg: dict) -> Dict[str, float]:
    """The ``cluster.plan_*`` values a config must state."""
    plan = config_plan(cfg)
    return {k: round(plan[src], nd) if nd else int(round(plan[src])) for k, (src, nd) in CONFIG_KEYS.items()}


def flops_per_token(L: GPTLayout, seq_len: int) -> float:
    """Model FLOPs (forward + backward) per trained token (see the module docstring)."""
    h, g, d, f = L.hidden_size, L.num_kv_heads, L.head_dim, L.ffn_hidden_size
    matmul = L.num_layers * (h * (L.num_heads * d + 2 * g * d) + L.num_heads * d * h + 3 * h * f) + L.vocab_size * h
    return 6 * matmul + 6 * L.num_layers * h * (seq_len / 2)


def expected_mfu(m: MegatronConfig, seq_len: int, gemm_efficiency: Optional[float] = None,
                 exposed_tp_comm: float = 0.12) -> Dict[str, float]:
    """MFU on paper: GEMM efficiency x (model / hardware FLOPs under recomputation) x (1 - exposed
    TP communication). GEMM efficiency defaults to 0.70 for >= 4k-token micro-batches, 0.55 at 1k."""
    if gemm_efficiency is None:
        gemm_efficiency = 0.70 if seq_len >= 4096 else (0.55 if seq_len <= 1024 else 0.62)
    recompute = {"full": 6 / 8, "selective": 0.97, "none": 1.0}[m.recompute]
    comm = 1 - (exposed_tp_comm if m.tp > 1 else 0.0)
    return {"gemm_efficiency": gemm_efficiency, "recompute_factor": recompute, "tp_comm_factor": comm,
            "mfu": gemm_efficiency * recompute * comm}


LAYOUTS = [  # (label, MegatronConfig kwargs, dp, precision_aware) of the docs' per-GPU table
    ("1 node: TP8 DP1, SP, full recompute, host Adam (precision-aware)",
     dict(tp=8, sp=True, recompute="full", optimizer_cpu_offload=True), 1, True),
    ("1 node: same, host Adam without use_precision_aware_optimizer",
     dict(tp=8, sp=True, recompute="full", optimizer_cpu_offload=True), 1, False),
    ("1 node: TP8 DP1, SP, full recompute, Adam on GPU", dict(tp=8, sp=True, recompute="full"), 1, True),
    ("2 nodes: TP8 DP2, SP, full recompute, dist. optimizer", dict(tp=8, sp=True, recompute="full"), 2, True),
    ("2 nodes: same without SP", dict(tp=8, sp=False, recompute="full"), 2, True),
    ("2 nodes: SP, no recompute (TE attention)", dict(tp=8, sp=True, recompute="none"), 2, True),
    ("2 nodes: TP4 PP2 DP2, SP, full recompute", dict(tp=4, pp=2, sp=True, recompute="full"), 2, True),
]


def markdown(seq: int = 6144) -> str:
    rows = ["| layout | weights | grads | optimizer on GPU | acts | log-prob chunks | overhead | **fit total** "
            "| host optimizer / GPU |", "|---|---|---|---|---|---|---|---|---|"]
    for label, kw, dp, pa in LAYOUTS:
        g = estimate_memory(QWEN25_32B, MegatronConfig(**kw), dp, seq, precision_aware=pa).as_gib()
        rows.append(f"| {label} | {g['weights']:.1f} | {g['grads']:.1f} | {g['optimizer']:.1f} | "
                    f"{g['act_checkpoints'] + g['act_layer']:.1f} | {g['logits']:.1f} | {g['overhead']:.0f} | "
                    f"**{g['total']:.1f}** | {g['host_optimizer_per_gpu']:.1f} |")
    return "\n".join(rows)


def load_config(path: str) -> dict:
    """A configs/megatron/*.yaml through the project's one experiment loader (extends resolved, the
    schema's settings rendered into their flags)."""
    from openrlhf_div.config import load_experiment

    return load_experiment(path)


def config_markdown(paths) -> str:
    rows = ["| config | GPU: fit (TE) | GPU: fit, local spec (no TE) | GPU: generation | GPU: weight sync | host / node "
            "| of which pinned |", "|---|---|---|---|---|---|---|"]
    seen = set()
    for path in paths:
        cfg = load_config(path)
        p = config_plan(cfg)
        key = tuple(round(v, 3) for v in p.values())
        layout = os.path.basename(path).rsplit("_megatron_", 1)[-1].replace(".yaml", "")
        if (layout, key) in seen:
            continue
        seen.add((layout, key))
        local = config_plan(cfg, attention="local")["gpu_fit_gib"]
        rows.append(f"| `*_megatron_{layout}.yaml` | {p['gpu_fit_gib']:.1f} | {local:.1f} | {p['gpu_generate_gib']:.1f} | "
                    f"{p['gpu_weight_sync_gib']:.1f} | {p['host_per_node_gib']:.0f} | "
                    f"{p['pinned_host_per_node_gib']:.0f} |")
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a configs/megatron/*.yaml (else the flags below)")
    p.add_argument("--world_size", default=None,
                   help="with --config: plan the actor on this many GPUs instead of the config's "
                        "(an integer, or 'authors' for the config's layout.authors_world_size)")
    p.add_argument("--markdown", action="store_true", help="print the tables of docs/scaling_megatron.md")
    # the Megatron actor's own flag names (--megatron.tp, as the driver and the experiment files'
    # openrlhf.megatron.tp); --tp / --pp stay as short aliases
    p.add_argument("--megatron.tp", "--tp", dest="tp", type=int, default=8, help="tensor-parallel size")
    p.add_argument("--megatron.pp", "--pp", dest="pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--seq", type=int, default=6144, help="tokens per micro-batch sequence (prompt + response)")
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--no_sp", action="store_true")
    p.add_argument("--recompute", default="full", choices=("none", "selective", "full"))
    p.add_argument("--cpu_offload", action="store_true")
    p.add_argument("--attention", choices=ATTENTION, default=None,
                   help="the attention to plan for: te (Transformer Engine's flash / fused attention) or local "
                        "(megatron-core's unfused attention, kept s^2 score matrices); default: the config's "
                        "(te unless megatron.transformer_impl is local)")


def run(a) -> int:
    """``openrlhf-div plan-memory``: one config's plan, the docs' tables, or any layout's."""
    if a.markdown:
        import glob

        from openrlhf_div import shipped

        # the checkout's or the installed wheel's configs/megatron, else the working directory's
        root = shipped.root(strict=False)
        if not os.path.isdir(os.path.join(root, "configs", "megatron")):
            root = os.getcwd()
        print(markdown(a.seq))
        print()
        print(config_markdown(sorted(glob.glob(os.path.join(root, "configs", "megatron", "[!_]*.yaml")))))
        return 0
    if a.config:
        cfg = load_config(a.config)
        world = getattr(a, "world_size", None)
        if world is not None:
            world = world_size_of(cfg, world)
            print(f"  plan at {world} GPUs (--world_size), token budgets: {budget_line(cfg)}")
            for k, v in config_plan(cfg, world, getattr(a, "attention", None)).items():
                print(f"  {k:<28} {v:8.1f}")
            return 0
        for k, v in config_plan(cfg, attention=getattr(a, "attention", None)).items():
            print(f"  {k:<28} {v:8.1f}")
        print("  cluster section:          " + ", ".join(f"{k}: {v}" for k, v in config_figures(cfg).items()))
        return 0
    mcfg = MegatronConfig(tp=a.tp, pp=a.pp, sp=not a.no_sp and a.tp > 1, recompute=a.recompute,
                          optimizer_cpu_offload=a.cpu_offload)
    mem = estimate_memory(QWEN25_32B, mcfg, a.dp, a.seq, a.micro_batch, attention=getattr(a, "attention", None)).as_gib()
    print(f"Qwen2.5-32B ({total_params(QWEN25_32B) / 1e9:.2f}B params), tp={mcfg.tp} pp={mcfg.pp} dp={a.dp} "
          f"sp={mcfg.sp} recompute={mcfg.recompute} cpu_offload={mcfg.optimizer_cpu_offload}, "
          f"attention={getattr(a, 'attention', None) or attention_impl(mcfg)}, "
          f"micro-batch {a.micro_batch} x {a.seq} tokens")
    for k, v in mem.items():
        print(f"  {k:<24} {v:8.2f}")
    mfu = expected_mfu(mcfg, a.seq)
    print(f"  model FLOPs/token        {flops_per_token(QWEN25_32B, a.seq) / 1e9:8.1f} GFLOP")
    print("  expected MFU             " + ", ".join(f"{k} {v:.2f}" for k, v in mfu.items()))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="openrlhf-div plan-memory", description=PLAN_HELP)
    add_arguments(p)
    return run(p.parse_args(argv))


PLAN_HELP = "memory plan and expected MFU of a Megatron actor layout (Qwen2.5-32B), on paper"
