"""Per-token log-probs and entropy straight from the last hidden states and the LM head.

The usual path computes ``logits = hidden @ W.T`` for every token (``[N, V]`` floats, 152k per
token for Qwen2.5), upcasts them to float32, takes a ``log_softmax`` and, for the entropy, an
``exp()`` copy -- and autograd keeps several of these ``[N, V]`` tensors alive until backward.
:func:`log_probs_from_hidden` never holds more than ``chunk_size x V`` logits: a custom autograd
function walks the tokens in chunks of rows, computes each chunk's logits, reduces them to a few
numbers per token and drops them; backward recomputes each chunk's logits from the saved
``hidden`` and ``W`` (the approach of Liger-Kernel's fused linear cross-entropy and verl's fused
linear-entropy kernels, here in plain torch). What is saved for backward is ``O(N)``.

With ``z = (hidden @ W.T + b) / T`` (float32) and ``p = softmax(z)``, per token:

* ``lse = log sum_v exp(z_v)``                    (max-shifted, float32)
* log-prob of the target ``y``:  ``lp = z_y - lse``
* full-vocabulary entropy:       ``H = lse - E``, ``E = sum_v p_v z_v``

Backward, with ``g_lp``, ``g_H`` the incoming gradients:

* ``dL/dz_v = g_lp (1[v = y] - p_v) + g_H p_v (E - z_v)``, ``dL/dlogits = dL/dz / T``
* ``dL/dhidden = dL/dlogits @ W``, ``dL/dW = dL/dlogits.T @ hidden`` (accumulated over chunks
  in float32), ``dL/db = sum over tokens of dL/dlogits``.

**Vocabulary shards.** The same kernel serves the tensor-parallel case
(:func:`openrlhf_div.engines.megatron.vocab_parallel.vocab_parallel_log_probs_from_hidden`):
``W`` is then this rank's ``[V / tp, H]`` slice starting at ``vocab_start``, rows at or beyond
``vocab_size`` (Megatron's vocabulary padding) are excluded, and per chunk the max is
all-reduced (MAX) and the sum-exp, the target logit and ``sum exp(z) z`` (SUM) over ``group``;
backward all-reduces ``dL/dhidden`` (each rank only sees its slice of the vocabulary).

**Dtypes.** ``hidden`` and ``W`` may be any float dtype (the same one): the logits are computed
in that dtype, exactly like ``nn.Linear`` followed by ``.float()``, and everything after that is
float32 (the log-sum-exp, the entropy, ``dL/dz``, and the ``dL/dW`` accumulator). The outputs
are float32.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["log_probs_from_hidden", "default_chunk_size"]

#: float32 logits per chunk by default (2**26 floats = 256 MiB): about 440 tokens at V = 151,936.
DEFAULT_CHUNK_ELEMENTS = 1 << 26


def default_chunk_size(vocab: int) -> int:
    """Rows per chunk so that one chunk of float32 logits holds ``DEFAULT_CHUNK_ELEMENTS`` floats."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, int(vocab)))


def _reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], temperature: float) -> torch.Tensor:
    """``(h @ w.T + b).float() / T`` for one chunk (``nn.Linear`` in the input dtype, then float32)."""
    z = torch.nn.functional.linear(h, w, b).float()
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _LinearLogProbs(torch.autograd.Function):
    """Chunked fused ``linear -> log_softmax -> gather (+ entropy)`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, need_entropy, vocab_start, n_valid, group):
        # hidden [N, H], weight [V_local, H] (only the first n_valid rows are real), targets [N] global ids.
        ctx.set_materialize_grads(False)
        N = hidden.shape[0]
        w = weight[:n_valid]
        b = None if bias is None else bias[:n_valid]
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lp = torch.empty_like(lse)
        expect = torch.empty_like(lse) if need_entropy else None
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < n_valid)
        local_t = torch.where(owned, local_t, torch.zeros_like(local_t))
        for s in range(0, N, chunk):
            e_ = min(N, s + chunk)
            if n_valid > 0:
                z = _chunk_logits(hidden[s:e_], w, b, temperature)
                m = z.max(dim=-1).values
            else:
                z = None
                m = torch.full((e_ - s,), float("-inf"), device=hidden.device)
            m = _reduce(m, dist.ReduceOp.MAX, group)
            red = torch.zeros(3 if need_entropy else 2, e_ - s, dtype=torch.float32, device=hidden.device)
            if z is not None:
                zy = z.gather(-1, local_t[s:e_].unsqueeze(-1)).squeeze(-1)
                red[1] = torch.where(owned[s:e_], zy, torch.zeros_like(zy))
                z.sub_(m.unsqueeze(-1))          # z - m  (<= 0)
                ez = torch.exp(z)
                red[0] = ez.sum(-1)
                if need_entropy:                 # sum exp(z - m) (z - m) as a batched dot; E = that / S + m
                    red[2] = torch.bmm(ez.unsqueeze(1), z.unsqueeze(2)).view(-1)
                del ez, z
            red = _reduce(red, dist.ReduceOp.SUM, group)
            lse[s:e_] = m + torch.log(red[0])
            lp[s:e_] = red[1] - lse[s:e_]
            if need_entropy:
                expect[s:e_] = red[2] / red[0] + m
        ctx.save_for_backward(hidden, weight, bias, local_t, owned, lse, expect)
        ctx.cfg = (temperature, chunk, need_entropy, n_valid, group)
        if need_entropy:
            return lp, lse - expect
        return lp, None

    @staticmethod
    def backward(ctx, g_lp, g_h):
        hidden, weight, bias, local_t, owned, lse, expect = ctx.saved_tensors
        temperature, chunk, need_entropy, n_valid, group = ctx.cfg
        if not need_entropy:
            g_h = None
        want_h, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        N = hidden.shape[0]
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        if (g_lp is None and g_h is None) or n_valid == 0:
            pass
        else:
            w = weight[:n_valid]
            b = None if bias is None else bias[:n_valid]
            for s in range(0, N, chunk):
                e_ = min(N, s + chunk)
                z = _chunk_logits(hidden[s:e_], w, b, temperature)
                p = torch.sub(z, lse[s:e_].unsqueeze(-1)).exp_()  # two chunk-sized buffers: z and p
                if g_h is not None:              # g_H p (E - z) - g_lp p
                    gz = z.neg_().add_(expect[s:e_].unsqueeze(-1)).mul_(g_h[s:e_].float().unsqueeze(-1))
                    if g_lp is not None:
                        gz.sub_(g_lp[s:e_].float().unsqueeze(-1))
                    gz.mul_(p)
                else:
                    del z
                    gz = p.mul_(-g_lp[s:e_].float().unsqueeze(-1))
                if g_lp is not None:             # + g_lp 1[v = y] on the owning rank
                    onehot = torch.where(owned[s:e_], g_lp[s:e_].float(), torch.zeros_like(lse[s:e_]))
                    gz.scatter_add_(-1, local_t[s:e_].unsqueeze(-1), onehot.unsqueeze(-1))
                if temperature != 1.0:
                    gz.div_(temperature)
                h_c = hidden[s:e_]
                if want_h:
                    grad_h[s:e_] = gz.to(w.dtype) @ w
                if want_w:
                    grad_w[:n_valid].addmm_(gz.t(), h_c.float())
                if want_b:
                    grad_b[:n_valid] += gz.sum(0)
                del gz, p
        if want_h and group is not None:
            _reduce(grad_h, dist.ReduceOp.SUM, group)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def fused_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    bias: Optional[torch.Tensor] = None, temperature: float = 1.0, return_entropy: bool = False,
                    chunk_size: Optional[int] = None, vocab_start: int = 0, vocab_size: Optional[int] = None,
                    group=None, caller: str = "log_probs_from_hidden"
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Shared entry of :func:`log_probs_from_hidden` and its vocabulary-parallel twin.

    ``weight`` holds the vocabulary rows ``[vocab_start, vocab_start + weight.shape[0])``; rows with
    a global index ``>= vocab_size`` are padding (probability 0). ``group``: the process group the
    vocabulary is split over, ``None`` for the whole vocabulary on this rank.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"{caller}: hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree; "
                         "hidden must be [..., H] with targets [...]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{caller}: weight {tuple(weight.shape)} must be [V, H] with H = hidden.shape[-1] = "
                         f"{hidden.shape[-1]} (pass the LM head's weight, e.g. model.lm_head.weight)")
    if not (hidden.is_floating_point() and weight.is_floating_point()) or hidden.dtype != weight.dtype:
        raise ValueError(f"{caller}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one float "
                         "dtype; cast the hidden states to the LM head's dtype")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{caller}: bias {tuple(bias.shape)} must be [V] = ({weight.shape[0]},)")
    if targets.is_floating_point():
        raise ValueError(f"{caller}: targets must be integer token ids, got {targets.dtype}")
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"{caller}: temperature must be > 0, got {temperature} (greedy decoding scores at T = 1)")
    if group is not None and not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        group = None
    v_local = weight.shape[0]
    if vocab_size is not None:
        total = int(vocab_size)
    else:  # every row of every shard is valid (an even split over the group)
        total = v_local * (dist.get_world_size(group) if group is not None else 1)
    n_valid = max(0, min(v_local, total - int(vocab_start)))
    chunk = default_chunk_size(v_local) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"{caller}: chunk_size must be >= 1, got {chunk_size}")
    t = targets.reshape(-1).long()
    if t.numel() and (bool((t < 0).any()) or bool((t >= total).any())):
        bad = t[(t < 0) | (t >= total)][0].item()
        raise ValueError(f"{caller}: target id {bad} is outside the vocabulary [0, {total}); replace ignore "
                         "indices (e.g. -100) by any valid id and mask those positions instead")
    h = hidden.reshape(-1, hidden.shape[-1])
    lp, ent = _LinearLogProbs.apply(h, weight, bias, t, temperature, chunk, bool(return_entropy),
                                    int(vocab_start), n_valid, group)
    lp = lp.view(targets.shape)
    return lp, (ent.view(targets.shape) if return_entropy else None)


def log_probs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                          return_entropy: bool = False, chunk_size: Optional[int] = None
                          ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``targets`` (and the full-vocabulary entropy) under ``softmax((hidden @ weight.T + bias) / T)``
    without materialising the ``[tokens, V]`` logits.

    Args:
        hidden: ``[..., H]`` last hidden states (after the final norm), any float dtype.
        weight: ``[V, H]`` the LM head (``model.lm_head.weight``), same dtype as ``hidden``.
        targets: ``[...]`` token ids in ``[0, V)`` (masked positions need a valid id too).
        bias: optional ``[V]`` LM-head bias.
        temperature: logits are divided by it (the rollout temperature), ``> 0``.
        return_entropy: also return ``H = -sum_v p_v log p_v``.
        chunk_size: tokens per chunk (at most ``chunk_size x V`` logits exist at once); default
            :func:`default_chunk_size` (256 MiB of float32 logits).

    Returns:
        ``(log_probs [...], entropy [...] or None)``, float32; differentiable with respect to
        ``hidden``, ``weight`` and ``bias`` (backward recomputes each chunk's logits).
    """
    return fused_log_probs(hidden, weight, targets, bias=bias, temperature=temperature,
                           return_entropy=return_entropy, chunk_size=chunk_size)
