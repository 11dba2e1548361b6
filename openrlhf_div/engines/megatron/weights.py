"""Hugging Face <-> Megatron-core ``GPTModel`` weights for the Qwen2 / Llama family.

Where megatron-bridge is installed (the GPU image) the actor uses it
(:mod:`openrlhf_div.engines.megatron.bridge`); this module is the documented fallback and the
reference the CPU tests check. It needs only ``torch`` (no Megatron import).

The mapping, for ``L`` layers, ``n_h`` query heads, ``n_g`` key/value heads (grouped-query
attention, ``n_g | n_h``), head size ``d``, hidden ``h``, MLP width ``f``, vocabulary ``V``
and tensor-parallel size ``tp`` (rank ``r``); HF names drop the ``model.`` prefix in the table::

    Megatron-core (local spec)                         Hugging Face                        TP split
    embedding.word_embeddings.weight      [V'/tp, h]   embed_tokens.weight [V, h]          rows, vocab padded to V'
    decoder.layers.i.input_layernorm.weight     [h]    layers.i.input_layernorm.weight     replicated
    decoder.layers.i.self_attention.linear_qkv.weight  layers.i.self_attn.{q,k,v}_proj     rows (column-parallel)
                               [n_g (n_h/n_g + 2) d / tp, h]   fused per query group, see below
    decoder.layers.i.self_attention.linear_qkv.bias    {q,k,v}_proj.bias (Qwen2)           rows, same layout
    decoder.layers.i.self_attention.linear_proj.weight layers.i.self_attn.o_proj.weight    columns (row-parallel)
    decoder.layers.i.pre_mlp_layernorm.weight   [h]    layers.i.post_attention_layernorm   replicated
    decoder.layers.i.mlp.linear_fc1.weight  [2f/tp, h] layers.i.mlp.{gate,up}_proj         per rank [gate_r; up_r]
    decoder.layers.i.mlp.linear_fc2.weight  [h, f/tp]  layers.i.mlp.down_proj.weight       columns (row-parallel)
    decoder.final_layernorm.weight              [h]    norm.weight                         replicated
    output_layer.weight                   [V'/tp, h]   lm_head.weight (untied only)        rows, vocab padded to V'

* **Fused qkv, interleaved per query group.** Megatron's ``linear_qkv`` output is, for each of
  the ``n_g`` key/value groups in order, that group's ``n_h/n_g`` query heads, then its key head,
  then its value head: ``[q_0..q_{k-1} k_0 v_0 | q_k..q_{2k-1} k_1 v_1 | ...]`` with
  ``k = n_h/n_g`` (``Attention.get_query_key_value_tensors``). Each TP rank holds a contiguous
  ``1/tp`` of those rows, i.e. ``n_g/tp`` whole groups when ``tp | n_g`` (Qwen2.5-32B: 8 groups,
  TP 8 gives one group per rank). The bias (Qwen2) follows the same layout.
* **Fused gate/up (SwiGLU fc1).** ``linear_fc1`` computes ``[gate; up]`` and Megatron's
  ``glu`` applies ``silu(first half) * second half`` *on each rank's slice*, so rank ``r`` holds
  ``[gate rows of r; up rows of r]`` -- not a contiguous slice of the full ``[gate; up]``.
* **Column-parallel** weights (``linear_qkv``, ``linear_fc1``, embedding, output layer) split
  rows; **row-parallel** weights (``linear_proj``, ``linear_fc2``) split columns; norms are
  replicated on every rank.
* **Vocabulary padding.** Megatron splits the vocabulary evenly over TP ranks; the embedding and
  output layer get ``V' = ceil(V / m) * m`` rows, ``m = divisor * lcm(tp, 8)`` (``divisor`` = 128, as
  Megatron's ``--make-vocab-size-divisible-by``). Padding rows are zero on import and dropped on
  export; the log-softmax masks them (``vocab_parallel.vocab_parallel_log_probs_from_hidden(...,
  vocab_size=V)``) so probabilities equal the Hugging Face model's over its ``V`` entries.
* **Tied embeddings** (``tie_word_embeddings``; small Qwen2 / Llama 3.2): Megatron's
  ``share_embeddings_and_output_weights`` drops ``output_layer.weight`` on the first pipeline
  stage and keeps a synchronised copy on the last; the HF export has no ``lm_head.weight``.
* **Transformer Engine naming.** With the TE layer spec the two pre-norms are fused into the
  following linear: ``input_layernorm.weight`` becomes
  ``self_attention.linear_qkv.layer_norm_weight`` and ``pre_mlp_layernorm.weight`` becomes
  ``mlp.linear_fc1.layer_norm_weight`` (``te_names=True``). ``_extra_state`` entries (TE's FP8
  metadata) carry no weights and are ignored.
* **Pipeline parallelism.** Megatron numbers layers locally on each stage; pass
  ``layers={local_index: global_index}`` for the stage's layers.

RoPE needs no permutation: Hugging Face Qwen2 / Llama and Megatron (``rotary_interleaved=False``)
both rotate the two halves of each head (``rotate_half``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "GPTLayout",
    "padded_vocab_size",
    "fuse_qkv",
    "split_qkv",
    "hf_to_megatron",
    "megatron_to_hf",
    "merge_tp_shards",
    "megatron_param_to_hf",
    "megatron_names",
    "SUPPORTED_ARCHITECTURES",
]

SUPPORTED_ARCHITECTURES = ("qwen2", "llama")
TensorSource = Union[Mapping[str, torch.Tensor], Callable[[str], torch.Tensor]]


RESHARD_TP = 8   # checkpoints reshard between every TP size dividing this (1, 2, 4, 8)


def padded_vocab_size(vocab_size: int, tp_size: int = 1, divisor: int = 128) -> int:
    """``V' = ceil(V / m) * m`` with ``m = divisor * lcm(tp, 8)``.

    Megatron pads the vocabulary to a multiple of ``divisor * tp``, which makes the embedding's
    global shape depend on TP (Qwen2.5's 152064 is 152064 at TP 4 and 152576 at TP 8), and a
    checkpoint saved at one TP then cannot be loaded at another. Padding to a multiple of
    ``divisor * lcm(tp, 8)`` gives every TP in {1, 2, 4, 8} the same ``V'``, so distributed
    checkpoints resume across those TP sizes; the padded rows are never sampled or scored.
    """
    if vocab_size < 1 or tp_size < 1 or divisor < 1:
        raise ValueError(f"vocab_size, tp_size and divisor must be >= 1, got {vocab_size}, {tp_size}, {divisor}")
    m = divisor * math.lcm(tp_size, RESHARD_TP)
    return int(math.ceil(vocab_size / m) * m)


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


def _rope_scaling(cfg) -> Optional[dict]:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, Mapping):
        kind = params.get("rope_type", params.get("type", "default"))
        return None if kind in (None, "default") else dict(params)
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        return dict(scaling)
    return None


@dataclass(frozen=True)
class GPTLayout:
    """The shapes that decide the mapping (from a Hugging Face config, :meth:`from_hf_config`)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    model_type: str = "qwen2"

    @classmethod
    def from_hf_config(cls, cfg, tp_size: int = 1, vocab_divisor: int = 128) -> "GPTLayout":
        """Read a ``transformers`` Qwen2 / Llama config; refuse what the mapping does not cover."""
        model_type = getattr(cfg, "model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"the Megatron actor supports model_type in {SUPPORTED_ARCHITECTURES} (Qwen2 / Qwen2.5 / "
                f"OmniSQL, Llama); got {model_type!r}. Use the DeepSpeed actor for other architectures."
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"expected SwiGLU (hidden_act='silu'), got hidden_act={act!r}")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported by the Megatron mapping")
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if heads % kv:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        if model_type == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(getattr(cfg, "attention_bias", False))
        if model_type == "qwen2" and getattr(cfg, "use_sliding_window", False):
            raise ValueError("Qwen2 sliding-window attention is not supported by the Megatron actor")
        return cls(
            num_layers=int(cfg.num_hidden_layers), hidden_size=int(cfg.hidden_size), num_heads=heads,
            num_kv_heads=kv, head_dim=int(head_dim), ffn_hidden_size=int(cfg.intermediate_size),
            vocab_size=int(cfg.vocab_size),
            padded_vocab_size=padded_vocab_size(int(cfg.vocab_size), tp_size, vocab_divisor),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), qkv_bias=qkv_bias,
            norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)), model_type=model_type,
        )

    def check_tp(self, tp_size: int) -> None:
        """Megatron's constraints on the tensor-parallel size for this model."""
        problems = []
        if self.num_heads % tp_size:
            problems.append(f"num_attention_heads={self.num_heads}")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            problems.append(f"num_key_value_heads={self.num_kv_heads} (neither divides the other)")
        if self.ffn_hidden_size % tp_size:
            problems.append(f"intermediate_size={self.ffn_hidden_size}")
        if self.padded_vocab_size % tp_size:
            problems.append(f"padded vocabulary {self.padded_vocab_size}")
        if problems:
            raise ValueError(f"tensor-parallel size {tp_size} does not divide {', '.join(problems)}")

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


# ---------------------------------------------------------------- elementary transforms
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: GPTLayout) -> torch.Tensor:
    """HF ``q [n_h d, ...]``, ``k, v [n_g d, ...]`` -> Megatron's per-group interleaved ``qkv``."""
    g, d = layout.num_kv_heads, layout.head_dim
    per = layout.num_heads // g
    tail = q.shape[1:]
    qg = q.reshape(g, per * d, *tail)
    kg = k.reshape(g, d, *tail)
    vg = v.reshape(g, d, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(layout.qkv_rows, *tail)


def split_qkv(qkv: torch.Tensor, layout: GPTLayout) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    g, d = layout.num_kv_heads, layout.head_dim
    per = layout.num_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(layout.num_heads * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail))


def _chunk(t: torch.Tensor, tp: int, r: int, dim: int) -> torch.Tensor:
    if t.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of a {tuple(t.shape)} tensor is not divisible by tp={tp}")
    return t.chunk(tp, dim=dim)[r].clone()


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] > rows:
        raise ValueError(f"cannot pad a vocabulary of {w.shape[0]} rows to {rows}")
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)


# ---------------------------------------------------------------- the name table
# (megatron suffix under decoder.layers.{i}., kind, HF names under model.layers.{i}.)
_LAYER_TABLE_LOCAL = [
    ("input_layernorm.weight", "replicated", ("input_layernorm.weight",)),
    ("self_attention.linear_qkv.weight", "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight")),
    ("self_attention.linear_qkv.bias", "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias")),
    ("self_attention.linear_proj.weight", "col_split", ("self_attn.o_proj.weight",)),
    ("pre_mlp_layernorm.weight", "replicated", ("post_attention_layernorm.weight",)),
    ("mlp.linear_fc1.weight", "fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.linear_fc2.weight", "col_split", ("mlp.down_proj.weight",)),
]
_TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_GLOBAL_TABLE = [
    ("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",)),
    ("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",)),
    ("output_layer.weight", "vocab", ("lm_head.weight",)),
]
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _layer_table(te_names: bool):
    return [(_TE_RENAMES.get(s, s) if te_names else s, k, h) for s, k, h in _LAYER_TABLE_LOCAL]


def _strip(name: str) -> str:
    """Drop DDP / Float16Module wrappers' ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def megatron_names(layout: GPTLayout, layers: Mapping[int, int], *, pre_process: bool = True,
                   post_process: bool = True, te_names: bool = False) -> List[str]:
    """The Megatron parameter names a stage holds (``layers``: local index -> global index)."""
    names = []
    if pre_process:
        names.append("embedding.word_embeddings.weight")
    for local in sorted(layers):
        for suffix, _, _ in _layer_table(te_names):
            if suffix.endswith("linear_qkv.bias") and not layout.qkv_bias:
                continue
            names.append(f"decoder.layers.{local}.{suffix}")
    if post_process:
        names.append("decoder.final_layernorm.weight")
        if not layout.tie_embeddings or not pre_process:
            names.append("output_layer.weight")
    return names


def _lookup(name: str, layers: Mapping[int, int], te_names: bool):
    """``megatron name -> (kind, [hf names])`` (global HF layer index)."""
    name = _strip(name)
    m = _LAYER_RE.match(name)
    if m:
        local, suffix = int(m.group(1)), m.group(2)
        if local not in layers:
            raise KeyError(f"{name}: local layer {local} is not in this stage's layer map {dict(layers)}")
        for s, kind, hf in _layer_table(te_names):
            if s == suffix:
                return kind, [f"model.layers.{layers[local]}.{h}" for h in hf]
        raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")
    for s, kind, hf in _GLOBAL_TABLE:
        if s == name:
            return kind, list(hf)
    raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")


def _get(src: TensorSource, name: str) -> torch.Tensor:
    if callable(src) and not isinstance(src, Mapping):
        return src(name)
    if name not in src:
        raise KeyError(f"Hugging Face checkpoint has no tensor {name!r}")
    return src[name]


# ---------------------------------------------------------------- HF -> Megatron
def hf_to_megatron_param(name: str, src: TensorSource, layout: GPTLayout, tp_size: int, tp_rank: int,
                         layers: Mapping[int, int], te_names: bool = False) -> torch.Tensor:
    """This TP rank's shard of Megatron parameter ``name``, built from HF tensors in ``src``."""
    kind, hf = _lookup(name, layers, te_names)
    if _strip(name) == "output_layer.weight" and layout.tie_embeddings:
        hf = ["model.embed_tokens.weight"]
    ts = [_get(src, h) for h in hf]
    if kind == "replicated":
        return ts[0].clone()
    if kind == "vocab":
        if ts[0].shape[0] != layout.vocab_size:
            raise ValueError(f"{hf[0]} has {ts[0].shape[0]} rows, the config says vocab_size={layout.vocab_size}")
        return _chunk(_pad_rows(ts[0], layout.padded_vocab_size), tp_size, tp_rank, 0)
    if kind == "qkv":
        return _chunk(fuse_qkv(*ts, layout), tp_size, tp_rank, 0)
    if kind == "col_split":
        return _chunk(ts[0], tp_size, tp_rank, 1)
    if kind == "fc1":
        gate, up = ts
        return torch.cat([_chunk(gate, tp_size, tp_rank, 0), _chunk(up, tp_size, tp_rank, 0)], dim=0)
    raise AssertionError(kind)  # pragma: no cover


def hf_to_megatron(src: TensorSource, layout: GPTLayout, tp_size: int = 1, tp_rank: int = 0, *,
                   layers: Optional[Mapping[int, int]] = None, pre_process: bool = True,
                   post_process: bool = True, te_names: bool = False) -> Dict[str, torch.Tensor]:
    """The Megatron state dict of one (TP rank, pipeline stage) from a HF state dict or getter.

    ``src`` maps HF names to tensors, or is a callable ``name -> tensor`` (lazy safetensors
    reads, so a 32B checkpoint is never held whole in memory). ``layers`` maps the stage's local
    layer indices to global ones (default: all layers, no pipeline parallelism).
    """
    layout.check_tp(tp_size)
    if layers is None:
        layers = {i: i for i in range(layout.num_layers)}
    return {n: hf_to_megatron_param(n, src, layout, tp_size, tp_rank, layers, te_names)
            for n in megatron_names(layout, layers, pre_process=pre_process, post_process=post_process,
                                    te_names=te_names)}


# ---------------------------------------------------------------- Megatron -> HF
def merge_tp_shards(name: str, shards: Sequence[torch.Tensor], layers: Optional[Mapping[int, int]] = None,
                    te_names: bool = False) -> torch.Tensor:
    """Reassemble the full (still Megatron-layout, vocabulary-padded) tensor from TP shards."""
    kind, _ = _lookup(name, layers or _AllLayers(), te_names)
    if kind == "replicated":
        return shards[0]
    if kind in ("vocab", "qkv"):
        return torch.cat(list(shards), dim=0)
    if kind == "col_split":
        return torch.cat(list(shards), dim=1)
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise AssertionError(kind)  # pragma: no cover


class _AllLayers(dict):
    """Identity layer map (local index == global index)."""

    def __contains__(self, key):  # noqa: D401
        return True

    def __getitem__(self, key):
        return key


def megatron_param_to_hf(name: str, full: torch.Tensor, layout: GPTLayout,
                         layers: Optional[Mapping[int, int]] = None,
                         te_names: bool = False) -> List[Tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs from one TP-merged Megatron tensor (:func:`merge_tp_shards`).

    A tied model's ``output_layer.weight`` (the last stage's copy) yields nothing.
    """
    layers = layers if layers is not None else _AllLayers()
    kind, hf = _lookup(name, layers, te_names)
    if _strip(name) == "output_layer.weight" and layout.tie_embeddings:
        return []
    if kind == "vocab":
        return [(hf[0], full[: layout.vocab_size])]
    if kind == "qkv":
        return list(zip(hf, split_qkv(full, layout)))
    if kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return [(hf[0], gate), (hf[1], up)]
    return [(hf[0], full)]


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], layout: GPTLayout, *,
                   layers: Optional[Mapping[int, int]] = None, te_names: bool = False) -> Dict[str, torch.Tensor]:
    """Merge the state dicts of all TP ranks of a stage into HF tensors (``_extra_state`` skipped)."""
    if not shards:
        raise ValueError("megatron_to_hf needs the state dict of every tensor-parallel rank, got none")
    out: Dict[str, torch.Tensor] = {}
    for name in shards[0]:
        if name.endswith("_extra_state"):
            continue
        missing = [r for r, s in enumerate(shards) if name not in s]
        if missing:
            raise KeyError(f"{name} is missing from the state dicts of TP ranks {missing}")
        full = merge_tp_shards(name, [s[name] for s in shards], layers, te_names)
        for hf_name, t in megatron_param_to_hf(name, full, layout, layers, te_names):
            out[hf_name] = t.clone()
    return out
