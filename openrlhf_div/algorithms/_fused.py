"""Fused per-token losses: the value and its hand-derived gradient, without an autograd graph.

Why (measured, ``docs/benchmarks.md`` "Policy losses"): written as plain torch expressions,
PPO-clip on a ``[256, 4096]`` float32 batch ran ~25 element-wise ops forward and as many
backward (the backward of ``maximum`` / ``minimum`` / ``where`` / ``clamp`` is several passes
each; ``where`` / ``masked_fill`` and comparisons returning bool are 3-15x slower on CPU than
an arithmetic pass), and autograd kept most intermediates alive until ``backward``. Here each
loss runs under ``no_grad``, mostly in place on a few buffers, together with
``coef = d value / d log_probs``, and the backward pass is the single product ``grad * coef``
(``-grad * coef`` for ``old_log_probs`` / ``ref_log_probs`` where the loss depends on
``lp - old`` / ``lp - ref`` only). Every loss here is elementwise in ``log_probs`` (Clip-Cov's
and KL-Cov's token choice depends on ``lp`` but is not differentiated, as before).

Each ``*_terms`` function returns ``(value, coef)`` on ``[B, T]`` (``coef`` None when not
asked for); both are exactly 0 at masked tokens, whatever the inputs hold there (selection by
bit mask, :class:`Keep`). The formulas are ALGORITHMS.md's; the values are the same floats
as the autograd expressions they replace except where noted at each function (k3 written
with ``exp`` as the spec does instead of ``expm1``; the JS-definition loss as one ``exp`` and
one ``log``; ``softplus(x)`` as ``log1p`` of an ``exp`` already computed, within an ulp). The
gradient conventions are autograd's (a ``clamp`` passes the gradient on its boundary, so
PPO-clip's unclipped branch keeps it at ``r = 1 + eps``), with one difference at an exact tie
``r = c`` of the dual clip (probability zero): autograd's ``minimum`` splits the gradient in
halves, here the unclipped branch gets all of it. ``tests/test_fused.py`` checks values and
gradients against the autograd expressions, and with ``gradcheck`` in float64.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from ._utils import _INT_VIEW, LOG_CLAMP

LOG2 = math.log(2.0)

Terms = Tuple[torch.Tensor, Optional[torch.Tensor]]


class Keep:
    """A mask, with what the fused losses derive from it computed once per call.

    ``mask=None`` keeps every token. Selection is by bit mask (see ``_utils.select``): a
    masked token's value becomes +0.0 even if it held inf or NaN.
    """

    def __init__(self, mask: Optional[torch.Tensor]):
        self.mask = mask
        self._bool = None if mask is None else mask.bool()
        self._bits: Dict[int, torch.Tensor] = {}

    def bits(self, like: torch.Tensor) -> torch.Tensor:
        w = like.element_size()
        b = self._bits.get(w)
        if b is None:
            b = self._bool.to(_INT_VIEW[w]).neg_()
            self._bits[w] = b
        return b

    def fill_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a fresh buffer) with +0.0 at masked tokens, in place."""
        if self.mask is not None:
            bits = self.bits(x)
            x.view(bits.dtype).bitwise_and_(bits)
        return x

    def filled(self, x: torch.Tensor) -> torch.Tensor:
        """A new tensor: ``x`` with +0.0 at masked tokens (one pass, no copy first)."""
        if self.mask is None:
            return x.clone()
        bits = self.bits(x)
        return torch.bitwise_and(x.view(bits.dtype), bits).view(x.dtype)


class _PerToken(torch.autograd.Function):
    """``value = fn(True)[0]`` with ``d value / d log_probs = coef`` and ``d value / d x = -coef``
    for each ``x`` in ``minus`` (terms that depend on ``log_probs - x`` only); for each ``x``
    in ``others`` the gradient is ``extra(grad)`` (``fn(True)[2]``, one callable each)."""

    @staticmethod
    def forward(ctx, fn, n_minus, log_probs, *inputs):
        out = fn(True)
        ctx.save_for_backward(out[1])
        ctx.n_minus = n_minus
        ctx.extras = out[2] if len(out) > 2 else ()
        return out[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (coef,) = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]  # log_probs, *minus, *others
        minus, others = needs[1:1 + ctx.n_minus], needs[1 + ctx.n_minus:]
        g = grad * coef if needs[0] or any(minus) else None
        return ((None, None, g if needs[0] else None)
                + tuple(-g if n else None for n in minus)
                + tuple(f(grad) if n else None for f, n in zip(ctx.extras, others)))


def per_token(fn: Callable, log_probs: torch.Tensor, *minus: torch.Tensor,
              others: Tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """Run ``fn(need_coef) -> (value, coef[, extras])`` and attach its gradient (see
    :class:`_PerToken`).

    Without a gradient to compute (no input requires one, or grad mode is off) ``fn`` runs
    with ``need_coef=False`` and skips the derivative's work."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (log_probs, *minus, *others)):
        return _PerToken.apply(fn, len(minus), log_probs, *minus, *others)
    with torch.no_grad():
        return fn(False)[0]


def _gate(x: torch.Tensor, clamped: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """1.0 where a clamp left ``x`` unchanged (its gradient passes), else 0.0; float, no bools
    (a comparison written to a float buffer is 3-4x faster on CPU than one returning bool)."""
    return torch.eq(clamped, x, out=torch.empty_like(x) if out is None else out)


# ------------------------------------------------------------------ PPO-clip
def ppo_clip_terms(
    lp: torch.Tensor, old: torch.Tensor, A: torch.Tensor, keep: Keep,
    eps_low: float, eps_high: float, dual_clip: Optional[float],
    need_coef: bool, stats: Optional[dict] = None,
) -> Terms:
    """PPO-clip with dual clip, ``l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`` and, for
    ``A < 0``, ``l = min(l, -c A)``; ``r = exp(clamp(lp - old, -20, 20))``.

    Split by the sign of ``A`` the same value is one clamp of ``r``:
    ``A > 0``: ``l = -A min(r, hi)``; ``A < 0``: ``l = -A clamp(r, lo, c)`` (``lo`` is
    ``min(1 - eps_low, 1 + eps_high)``, which is what ``clip`` does when the bounds cross);
    ``A = 0``: ``l = 0``. Both products are the very ones the max / min pick, so the values
    are bit-identical to the max / min form. ``d l / d lp = -A r`` where the clamp (and the
    log-ratio clamp) leaves its input unchanged, else 0.

    ``stats`` (a dict) receives ``"clipped"``: 1.0 where ``ppo_clip_mask`` is true
    (``A > 0`` and ``r > hi``, or ``A < 0`` and ``r < 1 - eps_low``), and (with ``need_coef``)
    ``"Ap"`` / ``"An"``: ``-A`` where ``A > 0`` / ``A < 0`` and 0 elsewhere (for Clip-Cov).
    """
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    lr = keep.fill_(torch.sub(lp, old))
    r = lr.clamp(-LOG_CLAMP, LOG_CLAMP)
    g_lr = _gate(lr, r, out=lr) if need_coef else None  # the log-ratio clamp's gradient gate
    r.exp_()
    nA = keep.fill_(torch.neg(A))
    An = nA.clamp(min=0.0)   # -A where A < 0, else 0
    Ap = nA.clamp_(max=0.0)  # -A where A > 0, else 0
    rp = r.clamp(max=hi)
    rn = r.clamp(min=min(lo, hi)) if dual_clip is None else r.clamp(min(lo, hi), dual_clip)
    value = torch.mul(Ap, rp).addcmul_(An, rn)
    if need_coef:
        gp = _gate(r, rp, out=rp)  # A > 0: r <= hi
        gn = _gate(r, rn, out=rn)  # A < 0: lo <= r <= c
        coef = torch.mul(Ap, gp).addcmul_(An, gn).mul_(r).mul_(g_lr)
        if stats is not None:  # from the gates, in buffers no longer needed
            clipped = torch.lt(Ap, 0.0, out=g_lr)                # A > 0
            clipped.addcmul_(clipped, gp, value=-1.0)             # ... and r > hi
            clipped.addcmul_(torch.lt(r, lo, out=gp), torch.gt(An, 0.0, out=gn))  # A < 0 and r < lo
            stats.update(clipped=clipped, Ap=Ap, An=An)
        return value, coef
    if stats is not None:
        clipped = torch.lt(Ap, 0.0, out=rp).mul_(torch.gt(r, hi, out=rn))
        clipped.addcmul_(torch.lt(r, lo, out=r), torch.gt(An, 0.0, out=An))
        stats["clipped"] = clipped
    return value, None


def clipped_count(lp, old, A, keep: Keep, eps_low: float, eps_high: float) -> torch.Tensor:
    """Number of valid tokens where ``ppo_clip_mask`` is true (``A > 0`` and ``r > 1 + eps_high``,
    or ``A < 0`` and ``r < 1 - eps_low``), as a 0-dim tensor; the clip fraction of losses that
    do not compute it themselves. No gradient."""
    with torch.no_grad():
        r = keep.fill_(torch.sub(lp, old)).clamp_(-LOG_CLAMP, LOG_CLAMP).exp_()
        sA = torch.sign(keep.fill_(A.to(r.dtype, copy=True)))
        pos = torch.gt(r, 1.0 + eps_high, out=torch.empty_like(r)).mul_(sA.clamp(min=0.0))
        neg = torch.lt(r, 1.0 - eps_low, out=r).mul_(sA.clamp_(max=0.0))
        return pos.sum() - neg.sum()


def _clip_count(r: torch.Tensor, nA: torch.Tensor, eps_low: float, eps_high: float,
                sign: float = -1.0) -> torch.Tensor:
    """Number of tokens where ``ppo_clip_mask(r, A)`` holds, from ``r`` and ``nA = sign * A``
    (``sign=1``: ``A`` itself; 0 at masked tokens), as a 0-dim tensor: two float comparisons
    and a dot product per side."""
    pos, neg = (torch.lt, torch.gt) if sign < 0 else (torch.gt, torch.lt)
    a = torch.gt(r, 1.0 + eps_high, out=torch.empty(r.shape, dtype=r.dtype, device=r.device))
    b = pos(nA, 0.0, out=torch.empty(r.shape, dtype=r.dtype, device=r.device))
    n = torch.dot(a.view(-1), b.view(-1))
    torch.lt(r, 1.0 - eps_low, out=a)
    neg(nA, 0.0, out=b)
    return n + torch.dot(a.view(-1), b.view(-1))


# ------------------------------------------------------------------ CISPO
def cispo_terms(lp, old, A, keep: Keep, eps_low: float, eps_high: float, need_coef: bool,
                stats: Optional[dict] = None, clip_eps: Tuple[float, float] = (0.2, 0.2)) -> Terms:
    """CISPO, ``l = -sg(clip(r, 1-eps_low, 1+eps_high)) A lp``: ``coef = -w A`` (the weight is
    detached, so every token keeps this gradient). Values bit-identical to ``-w * A * lp``.
    ``stats["clip_count"]``: ``ppo_clip_mask``'s count at ``clip_eps``."""
    r = keep.fill_(torch.sub(lp, old)).clamp_(-LOG_CLAMP, LOG_CLAMP).exp_()
    nA = keep.fill_(torch.neg(A))
    if stats is not None:
        stats["clip_count"] = _clip_count(r, nA, *clip_eps)
    coef = r.clamp_(1.0 - eps_low, 1.0 + eps_high).mul_(nA)  # -w A
    return keep.fill_(torch.mul(coef, lp)), coef


# ------------------------------------------------------------------ KL-Cov
def kl_cov_terms(lp, old, A, keep: Keep, ratio: float, k: float, need_coef: bool,
                 stats: Optional[dict] = None, clip_eps: Tuple[float, float] = (0.2, 0.2)) -> Terms:
    """KL-Cov: ``l = -A r``, plus ``k |log r|`` on the top ``floor(ratio * N)`` valid tokens by
    ``Cov_t = (A_t - mean A)(lp_t - mean lp)``; ``coef = -A r`` (+ ``k sign(log r)`` there),
    both 0 where the log-ratio clamp binds. The top tokens come from ``torch.topk`` as before;
    masked tokens, which all hold the same covariance, are set to -inf only if one of them
    made the top (then the pick is redone), the usual case costs no masking pass."""
    lr = keep.fill_(torch.sub(lp, old))
    log_r = lr.clamp(-LOG_CLAMP, LOG_CLAMP)
    g_lr = _gate(lr, log_r, out=lr) if need_coef else None
    r = torch.exp(log_r)
    nA = keep.fill_(torch.neg(A))
    if stats is not None:
        stats["clip_count"] = _clip_count(r, nA, *clip_eps)
    value = r.mul_(nA)  # -A r
    n_valid = value.numel() if keep.mask is None else -_count(keep.bits(value))
    n_pick = int(math.floor(ratio * n_valid))
    top = None
    if n_pick > 0:
        dt = value.dtype
        denom = (torch.ones_like(value) if keep.mask is None else keep.mask.to(dt)).sum().clamp(min=1.0)
        lp_f = keep.filled(lp.to(dt))
        m_na, m_lp = nA.sum() / denom, lp_f.sum() / denom  # m_na = -mean A
        cov = torch.sub(m_na, nA, out=nA).mul_(lp_f.sub_(m_lp))  # (A - mean A)(lp - mean lp)
        top = torch.topk(cov.reshape(-1), n_pick).indices
        if keep.mask is not None and not bool(keep.mask.reshape(-1)[top].bool().all()):
            bits = keep.bits(cov)  # a masked token made the top: mask with -inf and pick again
            cov.view(bits.dtype).bitwise_and_(bits).bitwise_or_(
                torch.bitwise_not(bits).bitwise_and_(_bits_of(-math.inf, cov)))
            top = torch.topk(cov.reshape(-1), n_pick).indices
        lr_top = log_r.reshape(-1)[top]
        top = unflat(top, value)
    coef = None
    if need_coef:
        g_top = None if top is None else g_lr[top]
        coef = g_lr.mul_(value)
        if top is not None:
            coef.index_put_(top, k * torch.sign(lr_top) * g_top, accumulate=True)
    if top is not None:
        value.index_put_(top, k * lr_top.abs(), accumulate=True)
    return value, coef


def unflat(idx: torch.Tensor, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row-major flat indices into ``like`` ``[B, T]`` as ``(rows, cols)`` (any memory layout)."""
    T = like.shape[1]
    return idx.div(T, rounding_mode="floor"), idx.remainder(T)


def _bits_of(x: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x, dtype=like.dtype, device=like.device).view(_INT_VIEW[like.element_size()])


def _count(bits: torch.Tensor) -> int:
    """Sum of an integer tensor, accumulated in int32 where that cannot overflow (4x faster
    on CPU than torch's default int64 accumulation)."""
    return int(bits.sum(dtype=torch.int32 if bits.numel() < 2**31 else torch.int64))


# ------------------------------------------------------------------ LAD
def lad_terms(lp, old, A, keep: Keep, divergence: str, eta: float, clip_eps, need_coef: bool,
              stats: Optional[dict] = None, clip_eps_metric: Tuple[float, float] = (0.2, 0.2)) -> Terms:
    """LAD at token granularity: ``z = clamp(A / eta)``, ``log x = clamp(lp - old - z)``,
    ``l = e^z f(x)`` with the generator written on ``log x`` (``F(log x) = f(x)``, the very
    expressions of ``divergences.py``, so the values are bit-identical, except that ``js``
    takes ``log1p`` of the ``exp`` it already has for ``softplus``: equal within an ulp) and
    ``coef = e^z F'(log x)`` where the clamp of ``log x`` passes (``F' = x f'(x)``, the spec's
    ``r f'(x)`` after the ``e^z``), 0 where ``clip_eps`` says PPO-clip would clip.
    ``stats["clip_count"]``: ``ppo_clip_mask``'s count at ``clip_eps_metric``."""
    lr = keep.fill_(torch.sub(lp, old))           # log r, unclamped
    Af = keep.filled(A)
    z = torch.div(Af, eta).clamp_(-LOG_CLAMP, LOG_CLAMP)
    lx_raw = torch.sub(lr, z)
    lx = lx_raw.clamp(-LOG_CLAMP, LOG_CLAMP)
    g = _gate(lx_raw, lx, out=lx_raw) if need_coef else None
    clipped = None
    if stats is not None or (need_coef and clip_eps is not None):
        r = lr.clamp_(-LOG_CLAMP, LOG_CLAMP).exp_()
        if stats is not None:
            stats["clip_count"] = _clip_count(r, Af, *clip_eps_metric, sign=1.0)
        if need_coef and clip_eps is not None:  # 1 - ppo_clip_mask(r, A), into g
            lo, hi = 1.0 - clip_eps[0], 1.0 + clip_eps[1]
            c = torch.gt(r, hi, out=torch.empty_like(r)).mul_(torch.gt(Af, 0.0, out=torch.empty_like(r)))
            c.addcmul_(torch.lt(r, lo, out=r), torch.lt(Af, 0.0, out=Af))
            clipped = c
    F, dF = _LAD_GENERATORS[divergence](lx, need_coef)
    ez = z.exp_()
    value = keep.fill_(F.mul_(ez))
    if not need_coef:
        return value, None
    coef = dF.mul_(ez).mul_(g)
    if clipped is not None:
        coef.addcmul_(coef, clipped, value=-1.0)
    return value, keep.fill_(coef)


def _lad_kl(lx, need):
    x = torch.exp(lx)
    F = torch.mul(x, lx)
    return F, (torch.add(F, x) if need else None)           # x log x; x (log x + 1)


def _lad_reverse_kl(lx, need):
    return torch.neg(lx), (torch.full_like(lx, -1.0) if need else None)


def _lad_jeffreys(lx, need):
    em = torch.expm1(lx)
    F = torch.mul(em, lx)                                    # (x - 1) log x
    return F, (torch.add(em, 1.0).mul_(lx).add_(em) if need else None)


def _lad_tv(lx, need):
    em = torch.expm1(lx)
    F = torch.abs(em)                                        # |x - 1|; x sign(x - 1)
    return F, (torch.sign(em).mul_(em.add_(1.0)) if need else None)


def _lad_hellinger(lx, need):
    h = torch.mul(lx, 0.5).expm1_()                          # sqrt(x) - 1
    F = torch.mul(h, h).mul_(0.5)
    return F, (torch.add(h, 1.0).mul_(h).mul_(0.5) if need else None)


def _lad_js(lx, need):
    x = torch.exp(lx)
    t = torch.log1p(x).sub_(LOG2)                            # softplus(log x) - log 2 (log x <= 20)
    F = torch.mul(x, lx).sub_(torch.add(x, 1.0).mul_(t)).mul_(0.5)
    return F, (torch.sub(lx, t).mul_(x).mul_(0.5) if need else None)  # x log(2x / (x + 1)) / 2


_LAD_GENERATORS = {"kl": _lad_kl, "reverse_kl": _lad_reverse_kl, "jeffreys": _lad_jeffreys,
                   "tv": _lad_tv, "hellinger": _lad_hellinger, "js": _lad_js}


# ------------------------------------------------------------------ DPH generator anchors
def dph_anchor_terms(lp, ref, keep: Keep, divergence: str, alpha: float, need_coef: bool) -> Terms:
    """The DPH generator-form anchor losses on ``log u = clamp(lp - ref, -20, 20)`` (the
    expressions of ``divergences.py``, bit-identical values but for ``js``'s ``softplus``,
    taken as ``log1p`` of the ``exp`` already computed: within an ulp), with ``coef = F'(log u)``
    where the clamp passes: ``forward_kl``: ``F = clamp(expm1(lu) - lu, -10, 10)``,
    ``F' = expm1(lu)`` inside the value clamp (which also covers the log-ratio clamp:
    ``F(+-20) > 10``); ``js``: ``F = u lu - (u + 1)(softplus(lu) - log 2)``,
    ``F' = u (lu - softplus(lu) + log 2)``; ``alpha``: ``F = (u^(1-a) - (1-a) u - a) / (a (a-1))``,
    ``F' = (1-a)(u^(1-a) - u) / (a (a-1))``."""
    lu_raw = keep.fill_(torch.sub(lp, ref))
    g = None
    if divergence != "dph_forward_kl" and need_coef and not within(lu_raw, -LOG_CLAMP, LOG_CLAMP):
        lu = lu_raw.clamp(-LOG_CLAMP, LOG_CLAMP)
        g = _gate(lu_raw, lu, out=lu_raw)
    else:
        lu = lu_raw.clamp_(-LOG_CLAMP, LOG_CLAMP)
    dF = None
    if divergence == "dph_forward_kl":
        em = torch.expm1(lu)
        F = torch.sub(em, lu, out=lu)
        if within(F, -10.0, 10.0):
            dF = em if need_coef else None
        else:
            value = F.clamp(-10.0, 10.0)
            dF = em.mul_(_gate(F, value, out=F)) if need_coef else None
            F = value
    elif divergence == "dph_js":
        u = torch.exp(lu)
        t = torch.log1p(u).sub_(LOG2)                         # softplus(lu) - log 2 (lu <= 20)
        F = torch.mul(u, lu).sub_(torch.add(u, 1.0).mul_(t))
        dF = torch.sub(lu, t, out=t).mul_(u) if need_coef else None
    else:  # dph_alpha
        a = alpha
        u = torch.exp(lu)
        ua = torch.mul(lu, 1.0 - a).exp_()                     # u^(1 - a)
        F = torch.sub(ua, torch.mul(u, 1.0 - a)).sub_(a).div_(a * (a - 1.0))
        dF = ua.sub_(u).mul_((1.0 - a) / (a * (a - 1.0))) if need_coef else None
    value = keep.fill_(F)
    if not need_coef:
        return value, None
    if g is not None:
        dF.mul_(g)
    return value, keep.fill_(dF)


# ------------------------------------------------------------------ k3 KL estimate
_K3_AT_LOG_CLAMP = math.expm1(-LOG_CLAMP) + LOG_CLAMP  # k3 at |log-ratio| = 20 (~19)


def k3_terms(lp: torch.Tensor, ref: torch.Tensor, keep: Keep, clamp: float, need_coef: bool) -> Terms:
    """``k3 = exp(d) - 1 - d`` with ``d = ref - lp`` clamped to [-20, 20], the value clamped
    to ``[-clamp, clamp]``; ``d k3 / d lp = 1 - exp(d)`` inside both clamps.

    Computed as the spec writes it, ``(exp(d) - 1) - d`` (``exp(d) - 1`` is exact for
    ``exp(d)`` in [0.5, 2]), not with ``expm1``: on CPU ``expm1`` costs twice an ``exp``
    (2.2 against 1.1 ms per million float32), which was a third of what k3 adds to PPO-clip.
    The price is float32 rounding: ``exp(d)`` is within one ulp, so the value and the
    gradient coefficient are off by at most ~1.2e-7 absolute (``expm1``: relative 1e-7),
    the size of the rounding of the float32 log-probs ``d`` is computed from; a k3 below
    ~1e-6 (|d| < ~1e-3) loses its leading digits. ``tests/test_fused.py`` bounds it against
    float64. For ``clamp < 19`` the log-ratio clamp never binds without the value clamp
    binding too (``k3(+-20) >= 19``), so one gate covers both.
    """
    value, neg_coef = _k3(lp, ref, keep, clamp, need_coef)
    return value, None if neg_coef is None else neg_coef.neg_()


def _k3(lp, ref, keep, clamp, need_coef):
    """:func:`k3_terms` with ``-coef`` (the registry folds the sign into its weight)."""
    d = keep.fill_(torch.sub(ref, lp))
    g_lr = None
    if need_coef and clamp >= _K3_AT_LOG_CLAMP and not within(d, -LOG_CLAMP, LOG_CLAMP):
        dc = d.clamp(-LOG_CLAMP, LOG_CLAMP)
        g_lr = _gate(d, dc, out=d)
        d = dc
    else:
        d.clamp_(-LOG_CLAMP, LOG_CLAMP)
    e = torch.exp(d).sub_(1.0)
    k = torch.sub(e, d, out=d)
    if within(k, -clamp, clamp):
        return k, e if need_coef else None
    value = k.clamp(-clamp, clamp)
    if not need_coef:
        return value, None
    e.mul_(_gate(k, value, out=k))
    if g_lr is not None:
        e.mul_(g_lr)
    return value, e


# ------------------------------------------------------------------ divergence-definition JS
_JS_DEF_Y_MAX = 30.0  # exp(30) is finite in float32; beyond y = 20.7 the clamp below binds anyway


def js_def_terms(lp: torch.Tensor, ref: torch.Tensor, keep: Keep, on: str, need_coef: bool) -> Terms:
    """``l = exp(s) - s - 1`` with ``s = log m - ref`` (``on="anchor"``) or ``s = log m - lp``
    (``on="online"``), ``log m = logsumexp(ref, lp) - log 2``, ``s`` clamped to [-20, 20].

    With ``y = lp - ref`` (anchor) or ``y = ref - lp`` (online), ``s = log((1 + e^y) / 2)``,
    so with ``w = e^y``: ``q = expm1(s) = (w - 1) / 2`` and ``s = log(1 + q)``, and
    ``l = q - log(1 + q)``: one ``exp`` and one ``log`` instead of ``softplus`` (an exp and
    a log1p) and ``expm1``; the rounding error is the same order (~1e-7 absolute in
    float32). ``s >= -log 2`` always; ``s > 20`` exactly when ``q > expm1(20)``, where the
    value is ``expm1(20) - 20`` and the gradient 0. Elsewhere
    ``d l / d y = (e^s - 1) ds/dy = q w / (1 + w) = q (q + 1/2) / (q + 1)``.
    """
    value, coef, sign = _js_def(lp, ref, keep, on, need_coef)
    return value, coef.neg_() if coef is not None and sign < 0 else coef


def _js_def(lp, ref, keep, on, need_coef):
    """:func:`js_def_terms` as ``(value, c, sign)`` with ``coef = sign * c``."""
    y = keep.fill_(torch.sub(lp, ref) if on == "anchor" else torch.sub(ref, lp))
    half_w = y.clamp_(max=_JS_DEF_Y_MAX).exp_().mul_(0.5)  # w / 2 = q + 1/2
    q = torch.sub(half_w, 0.5)                               # (w - 1) / 2 = expm1(s)
    q_max = float(torch.expm1(torch.tensor(LOG_CLAMP, dtype=q.dtype)))
    g = None
    if not within(q, -1.0, q_max):  # the clamp of s at 20 binds somewhere
        if need_coef:
            g = _gate(q, q.clamp(max=q_max))
        q.clamp_(max=q_max)
        torch.add(q, 0.5, out=half_w)
    t = torch.add(q, 1.0)                                    # (1 + w) / 2 = e^s
    coef = None
    if need_coef:
        coef = half_w.mul_(q).div_(t)
        if g is not None:
            coef.mul_(g)
    value = q.sub_(t.log_())                                 # q - s
    return value, coef, (1.0 if on == "anchor" else -1.0)


def within(x: torch.Tensor, lo: float, hi: float) -> bool:
    """True when every element of ``x`` lies in ``[lo, hi]`` (a clamp to it is then the
    identity and its gradient gate all ones), checked with one read of ``x``. CPU only: on
    an accelerator the answer would cost a host sync, so there it is always False and the
    clamp and gate run. NaN anywhere gives False."""
    if x.device.type != "cpu":
        return False
    if x.numel() == 0:
        return True
    mn, mx = torch.aminmax(x)
    return bool(mn >= lo) and bool(mx <= hi)
