"""Per-GPU memory and model-FLOPs utilisation of a Megatron actor layout, on paper.

``python -m openrlhf_div.engines.megatron.memory [--config configs/megatron/X.yaml] [--seq 6144]``
prints the table docs/scaling_megatron.md quotes. Every term is a formula of the model shape
(:class:`~.weights.GPTLayout`), the layout (:class:`~.config.MegatronConfig`, data-parallel size
``dp``) and the micro-batch (``b`` sequences of ``s`` tokens); bytes, per GPU:

* parameters ``P`` per GPU = (per-layer matrices x layers per stage + the stage's embedding /
  output layer) / tp; norms are replicated (negligible);
* weights ``2P`` (bf16); gradients ``4P`` (Megatron's fp32 grad buffer) or ``2P``;
* optimiser ``12P`` (fp32 master + Adam m, v) divided by ``dp`` with the distributed optimiser,
  times ``1 - offload_fraction`` with the host optimiser;
* activations with full recomputation: each layer keeps its input ``2 s b h`` (divided by tp
  with sequence parallelism), times the layers of the stage (times ``pp`` micro-batches in
  flight for the first 1F1B stage); plus one layer's working set during its recomputed forward
  and backward, ``2 x 2 s b (6h + 2 g d + 3f) / tp`` (flash attention: no ``s^2`` term); with
  selective (attention) or no recomputation, Korthikanti et al.'s ``s b h (34 + ...) / tp`` per
  layer without the attention-score term;
* logits: ``6 x 4 s b V'/tp`` (fp32 logits, the gathered target slice, ``z``, ``exp``, the saved
  probabilities and their gradient in :mod:`.vocab_parallel`);
* a fixed overhead (CUDA contexts of the actor and a sleeping vLLM worker, NCCL buffers,
  allocator fragmentation), 5 GiB by default.

Model FLOPs per trained token (the MFU numerator; recomputation not counted):
``6 (L (h (h + 2gd) + h^2 + 3 h f) + V h) + 6 L h s_bar`` with ``s_bar`` the mean causal context
(``s / 2``). MFU = model FLOPs / (time x GPUs x peak); :func:`expected_mfu` multiplies the
assumed efficiencies of the layout instead of measuring (no GPU in the CI).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Dict, Optional

from .config import MegatronConfig
from .weights import GPTLayout, padded_vocab_size

GiB = float(1 << 30)
H100_BF16_DENSE_TFLOPS = 989.0

# Qwen2.5-32B / Qwen2.5-Coder-32B / OmniSQL-32B (config.json of the released checkpoints)
QWEN25_32B = GPTLayout(num_layers=64, hidden_size=5120, num_heads=40, num_kv_heads=8, head_dim=128,
                       ffn_hidden_size=27648, vocab_size=152064, padded_vocab_size=152064,
                       tie_embeddings=False, qkv_bias=True, norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=32768, model_type="qwen2")


def with_tp(layout: GPTLayout, tp: int, divisor: int = 128) -> GPTLayout:
    from dataclasses import replace

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
    params_per_gpu: float
    weights: float
    grads: float
    optimizer: float
    act_checkpoints: float
    act_layer: float
    logits: float
    overhead: float
    host_optimizer: float

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.act_checkpoints + self.act_layer + self.logits
                + self.overhead)

    def as_gib(self) -> Dict[str, float]:
        keys = ("weights", "grads", "optimizer", "act_checkpoints", "act_layer", "logits", "overhead")
        out = {k: getattr(self, k) / GiB for k in keys}
        out["total"] = self.total / GiB
        out["host_optimizer_per_gpu"] = self.host_optimizer / GiB
        out["params_per_gpu_B"] = self.params_per_gpu / 1e9
        return out


def estimate_memory(L: GPTLayout, m: MegatronConfig, dp: int, seq_len: int, micro_batch: int = 1,
                    overhead_gib: float = 5.0) -> Memory:
    """Per-GPU bytes of the busiest pipeline stage (see the module docstring)."""
    L = with_tp(L, m.tp, m.vocab_divisor)
    tp, pp = m.tp, m.pp
    h, s, b = L.hidden_size, seq_len, micro_batch
    layers = math.ceil(L.num_layers / pp)
    emb = L.padded_vocab_size * h
    stage_emb = emb * (2 if (pp == 1 and not L.tie_embeddings) else 1)
    P = (layers * layer_params(L) + stage_emb) / tp
    weights = (2 if m.bf16 else 4) * P
    grads = (4 if (m.grad_reduce_in_fp32 or not m.bf16) else 2) * P
    opt_full = 12 * P / (dp if m.distributed_optimizer else 1)
    off = m.optimizer_offload_fraction if m.optimizer_cpu_offload else 0.0
    sp = tp if m.sp else 1
    in_flight = pp                                    # 1F1B: the first stage holds pp micro-batches
    g, d, f = L.num_kv_heads, L.head_dim, L.ffn_hidden_size
    layer_work = 2 * 2 * s * b * (6 * h + 2 * g * d + 3 * f) / tp
    if m.recompute == "full":
        ckpt = 2 * s * b * h / sp * layers * in_flight
        act_layer = layer_work
    else:
        per_layer = s * b * h * (34 + (3 * f - 8 * h) * 2 / h) / sp     # SwiGLU-adjusted, flash attention
        ckpt = per_layer * layers * in_flight
        act_layer = 0.0
    logits = 6 * 4 * s * b * L.padded_vocab_size / tp
    return Memory(P, weights, grads, opt_full * (1 - off), ckpt, act_layer, logits, overhead_gib * GiB,
                  opt_full * off)


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


def _cfg_from_yaml(path: str):
    import yaml

    with open(path) as fh:
        cfg = yaml.safe_load(fh)
    flags = cfg.get("openrlhf", {})
    mcfg = MegatronConfig(**{k.split(".", 1)[1]: v for k, v in flags.items() if k.startswith("megatron.")})
    gpus = int(flags.get("actor.num_nodes", 1)) * int(flags.get("actor.num_gpus_per_node", 8))
    return cfg, mcfg, gpus // mcfg.model_parallel_size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="per-GPU memory and expected MFU of a Megatron actor layout (Qwen2.5-32B)")
    p.add_argument("--config", help="a configs/megatron/*.yaml (else the flags below)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--seq", type=int, default=6144, help="tokens per micro-batch sequence (prompt + response)")
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--no_sp", action="store_true")
    p.add_argument("--recompute", default="full", choices=("none", "selective", "full"))
    p.add_argument("--cpu_offload", action="store_true")
    a = p.parse_args(argv)
    if a.config:
        _, mcfg, dp = _cfg_from_yaml(a.config)
    else:
        mcfg = MegatronConfig(tp=a.tp, pp=a.pp, sp=not a.no_sp and a.tp > 1, recompute=a.recompute,
                              optimizer_cpu_offload=a.cpu_offload)
        dp = a.dp
    mem = estimate_memory(QWEN25_32B, mcfg, dp, a.seq, a.micro_batch).as_gib()
    print(f"Qwen2.5-32B ({total_params(QWEN25_32B) / 1e9:.2f}B params), tp={mcfg.tp} pp={mcfg.pp} dp={dp} "
          f"sp={mcfg.sp} recompute={mcfg.recompute} dist_opt={mcfg.distributed_optimizer} "
          f"cpu_offload={mcfg.optimizer_cpu_offload}, micro-batch {a.micro_batch} x {a.seq} tokens")
    for k, v in mem.items():
        print(f"  {k:<24} {v:8.2f}")
    mfu = expected_mfu(mcfg, a.seq)
    print(f"  model FLOPs/token        {flops_per_token(QWEN25_32B, a.seq) / 1e9:8.1f} GFLOP")
    print("  expected MFU             " + ", ".join(f"{k} {v:.2f}" for k, v in mfu.items()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
