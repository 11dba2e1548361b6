"""KV-cache decoders for :func:`.generation.generate`.

:class:`HFDecoder` drives any Hugging Face causal LM through ``past_key_values``
(``DynamicCache``). :class:`LlamaLikeDecoder` is a lean path for the Qwen2 / Llama
architecture (full attention only): it reuses the model's own modules (embeddings,
projections, RMSNorms, MLPs, rotary embedding, LM head) but keeps the keys/values in
preallocated tensors and calls ``scaled_dot_product_attention`` directly, skipping the
per-step mask building and cache bookkeeping of the generic path. For tiny models that
overhead is most of a decode step (about 2.5x faster decoding here); the numbers are the
same computation (tests compare the sampler's log-probs with the training forward).

:class:`StaticLlamaDecoder` is that lean decoder with a static-shape token step (the whole
preallocated cache attended under a device-side key mask, the write column a device tensor):
no host synchronisation, so on CUDA it is captured once as a CUDA graph and replayed.

All expose ``prefill(ids, attn, pos) -> last logits`` and
``step(tok, attn, pos) -> logits``: ``attn`` is the running 0/1 key mask of every cached
position, ``pos`` the position ids (``cumsum(attn) - 1``, so left padding is invisible).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class HFDecoder:
    def __init__(self, model, n_rows: int, max_len: int):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache()

    def prefill(self, ids, attn, pos):
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def step(self, tok, attn, pos):
        out = self.model(input_ids=tok.unsqueeze(-1), attention_mask=attn, position_ids=pos.unsqueeze(-1),
                         past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1, :]


class LlamaLikeDecoder:
    SUPPORTED = ("qwen2", "llama")

    @classmethod
    def supports(cls, model) -> bool:
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in cls.SUPPORTED:
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"])):
            return False
        inner = getattr(model, "model", None)
        need = ("embed_tokens", "layers", "norm", "rotary_emb")
        return inner is not None and all(hasattr(inner, a) for a in need) and hasattr(model, "lm_head")

    def __init__(self, model, n_rows: int, max_len: int):
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

        self.rope = apply_rotary_pos_emb
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(model.parameters())
        shape = (n_rows, self.n_kv, max_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in self.inner.layers]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in self.inner.layers]
        self.len = 0

    def _run(self, x, pos, mask):
        """``x`` [N, T, H] at cache columns ``len .. len+T``; ``mask`` [N, 1, T, len+T] bool."""
        N, T, _ = x.shape
        cos, sin = self.inner.rotary_emb(x, pos)
        s, e = self.len, self.len + T
        for i, layer in enumerate(self.inner.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(N, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = a.k_proj(h).view(N, T, self.n_kv, self.head_dim).transpose(1, 2)
            v = a.v_proj(h).view(N, T, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            self.k[i][:, :, s:e] = k
            self.v[i][:, :, s:e] = v
            o = F.scaled_dot_product_attention(q, self.k[i][:, :, :e], self.v[i][:, :, :e], attn_mask=mask,
                                               scale=a.scaling, enable_gqa=self.n_kv != self.n_heads)
            x = x + a.o_proj(o.transpose(1, 2).reshape(N, T, self.n_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.len = e
        return self.model.lm_head(self.inner.norm(x[:, -1:, :]))[:, -1, :]

    def prefill(self, ids, attn, pos):
        T = ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        # a padded query row may see itself, so no row is fully masked (no NaN); real rows never see padding
        mask = causal & (attn.bool()[:, None, None, :] | torch.eye(T, dtype=torch.bool, device=ids.device))
        return self._run(self.inner.embed_tokens(ids), pos, mask)

    def step(self, tok, attn, pos):
        mask = attn.bool().clone()
        mask[:, -1] = True  # a finished row's pad query sees itself (its output is discarded)
        return self._run(self.inner.embed_tokens(tok.unsqueeze(-1)), pos.unsqueeze(-1), mask[:, None, None, :])


class StaticLlamaDecoder(LlamaLikeDecoder):
    """:class:`LlamaLikeDecoder` whose token step has static shapes and no host synchronisation.

    The prefill is the parent's (same numbers). Each :meth:`step` attends over the whole preallocated
    cache, ``max_len`` columns, with a key mask held on the device (``keys [rows, max_len]``) and the
    column it writes (``cur``, a device tensor) advanced in place: no Python value of the device's
    state is read, no shape depends on the step, so the step can be captured once as a CUDA graph
    and replayed (``graph=True``, CUDA only). The step reads its inputs from fixed buffers
    (``tok``, ``live``, ``pos``) that :meth:`step` copies into.

    Not bit-exact with :class:`LlamaLikeDecoder`'s step: the attention runs over ``max_len`` instead of
    the filled ``len + 1`` columns (the extra ones masked out), and torch's CPU attention kernel gives
    different last bits for a different key length even then (measured: docs/benchmarks.md,
    "Static-shape decode step"; a plain masked softmax does not).
    """

    static = True

    def __init__(self, model, n_rows: int, max_len: int, graph: bool = False):
        super().__init__(model, n_rows, max_len)
        dev = next(model.parameters()).device
        if graph and dev.type != "cuda":
            raise ValueError(f"decode step 'graph' needs a CUDA model, this one is on {dev.type}; "
                             "use 'static' or 'dynamic'")
        self.max_len = max_len
        self.keys = torch.zeros(n_rows, max_len, dtype=torch.bool, device=dev)   # real tokens per column
        self.cur = torch.zeros(1, dtype=torch.long, device=dev)                # the column the step writes
        self.cols = torch.arange(max_len, device=dev)
        self.tok = torch.zeros(n_rows, dtype=torch.long, device=dev)
        self.live = torch.zeros(n_rows, dtype=torch.bool, device=dev)
        self.pos = torch.zeros(n_rows, dtype=torch.long, device=dev)
        self.use_graph = graph
        self.graph = None
        self.out = None

    def prefill(self, ids, attn, pos):
        logits = super().prefill(ids, attn, pos)
        self.keys[:, : ids.shape[1]] = attn.bool()
        self.cur.fill_(ids.shape[1])
        return logits

    def _static_step(self):
        """One token step from the input buffers; every shape fixed, every update in place."""
        N = self.tok.shape[0]
        x = self.inner.embed_tokens(self.tok[:, None])
        self.keys.index_copy_(1, self.cur, self.live[:, None])
        # a finished row's pad query sees itself, so no row is fully masked (its output is discarded)
        mask = (self.keys | (self.cols == self.cur))[:, None, None, :]
        cos, sin = self.inner.rotary_emb(x, self.pos[:, None])
        for i, layer in enumerate(self.inner.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(N, 1, self.n_heads, self.head_dim).transpose(1, 2)
            k = a.k_proj(h).view(N, 1, self.n_kv, self.head_dim).transpose(1, 2)
            v = a.v_proj(h).view(N, 1, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            self.k[i].index_copy_(2, self.cur, k)
            self.v[i].index_copy_(2, self.cur, v)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, scale=a.scaling,
                                               enable_gqa=self.n_kv != self.n_heads)
            x = x + a.o_proj(o.transpose(1, 2).reshape(N, 1, self.n_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.cur.add_(1)
        return self.model.lm_head(self.inner.norm(x))[:, -1, :]

    def _capture(self):
        """Record :meth:`_static_step` as a CUDA graph (after two warm-up runs on a side stream, each
        undone: they write the same cache column the first replay writes, and ``cur`` is set back)."""
        start = self.cur.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._static_step()
                self.cur.copy_(start)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._static_step()
        self.graph = graph

    def step(self, tok, attn, pos):
        """``attn``: only its last column is read (whether ``tok`` is a real token of its row)."""
        self.tok.copy_(tok)
        self.live.copy_(attn[:, -1].bool())
        self.pos.copy_(pos)
        if not self.use_graph:
            return self._static_step()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out.clone()   # the graph's output buffer is rewritten by the next replay


DECODE_STEPS = ("dynamic", "static", "graph")


def make_decoder(model, n_rows: int, max_len: int, fast=None, step: str = "dynamic"):
    """The lean decoder when the architecture allows it (``fast=None``/``True``), else HF's.

    ``step``: ``"dynamic"`` (the lean decoder's step over the filled cache columns), ``"static"``
    (:class:`StaticLlamaDecoder`: fixed shapes, no host synchronisation) or ``"graph"`` (that step
    captured once as a CUDA graph and replayed; CUDA only). The last two need the lean decoder."""
    if step not in DECODE_STEPS:
        raise ValueError(f"decode step {step!r}: one of {', '.join(DECODE_STEPS)}")
    lean = fast is not False and LlamaLikeDecoder.supports(model)
    if step != "dynamic":
        if not lean:
            why = "fast=False" if fast is False else f"a {getattr(model.config, 'model_type', type(model).__name__)!r} model"
            raise ValueError(f"decode step {step!r} needs the lean decoder ({LlamaLikeDecoder.SUPPORTED} models with "
                             f"full attention, fast not False), not {why}; use decode step 'dynamic'")
        return StaticLlamaDecoder(model, n_rows, max_len, graph=step == "graph")
    if lean:
        return LlamaLikeDecoder(model, n_rows, max_len)
    if fast is True:
        raise ValueError(f"fast decoding supports {LlamaLikeDecoder.SUPPORTED} models with full attention only, "
                         f"not {getattr(model.config, 'model_type', type(model).__name__)!r}")
    return HFDecoder(model, n_rows, max_len)
