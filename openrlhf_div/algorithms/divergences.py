"""f-divergence generators, written on the log of their argument (ALGORITHMS.md 4 and 5).

Every function takes ``log_u`` (already clamped by the caller or clamped here to +-20) and
returns ``f(u)`` elementwise, so large ratios never overflow: ``log((u+1)/2)`` is computed as
``softplus(log u) - log 2``.

LAD generators (section 5), for ``x = pi_theta / (pi_old exp(A/eta))``:

=============  =====================================  ========
name           f(x)                                   strict
=============  =====================================  ========
kl             x log x                                no
reverse_kl     -log x                                 no
jeffreys       (x - 1) log x                          no
tv             |x - 1|                                yes
hellinger      0.5 (sqrt(x) - 1)^2                    yes
js             0.5 (x log x - (x+1) log((x+1)/2))     yes
=============  =====================================  ========

DPH generators (section 4), for ``u = pi_theta / pi_ref`` on reference samples:

* ``dph_forward_kl``: ``u - 1 - log u`` -> ``KL(pi_ref || pi_theta)`` (mass-covering)
* ``dph_js``: ``u log u - (u+1) log((u+1)/2)`` -> ``2 JS(pi_ref, pi_theta)``
* ``dph_alpha``: ``(u^(1-a) - (1-a) u - a) / (a (a-1))``, ``a`` in (0, 1)
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from ._utils import clamp_log, unknown_name_error

LOG2 = math.log(2.0)


def _kl(lx):
    return torch.exp(lx) * lx


def _reverse_kl(lx):
    return -lx


def _jeffreys(lx):
    return torch.expm1(lx) * lx


def _tv(lx):
    return torch.abs(torch.expm1(lx))


def _hellinger(lx):
    return 0.5 * torch.expm1(0.5 * lx) ** 2


def _js_core(lx):
    """``x log x - (x+1) log((x+1)/2)`` without overflow."""
    return torch.exp(lx) * lx - (torch.exp(lx) + 1.0) * (F.softplus(lx) - LOG2)


def _js(lx):
    return 0.5 * _js_core(lx)


def _dph_forward_kl(lu):
    # u - 1 - log u, clamped to [-10, 10] like the k3 estimator
    return (torch.expm1(lu) - lu).clamp(-10.0, 10.0)


def _dph_js(lu):
    return _js_core(lu)


def check_alpha(alpha) -> float:
    if alpha is None:
        raise ValueError("the alpha divergence needs alpha in (0, 1); got None")
    a = float(alpha)
    if not (0.0 < a < 1.0):
        raise ValueError(
            f"alpha must lie strictly inside (0, 1), got {alpha!r} "
            "(alpha -> 1 is dph_forward_kl, alpha -> 0 reverse KL; use those names instead)"
        )
    return a


def _dph_alpha(lu, alpha):
    a = check_alpha(alpha)
    # (u^(1-a) - (1-a) u - a) / (a (a - 1)), with u^(1-a) = exp((1-a) log u)
    return (torch.exp((1.0 - a) * lu) - (1.0 - a) * torch.exp(lu) - a) / (a * (a - 1.0))


_GENERATORS: Dict[str, Callable] = {
    "kl": _kl,
    "reverse_kl": _reverse_kl,
    "jeffreys": _jeffreys,
    "tv": _tv,
    "hellinger": _hellinger,
    "js": _js,
    "dph_forward_kl": _dph_forward_kl,
    "dph_js": _dph_js,
    "dph_alpha": _dph_alpha,
}

LAD_DIVERGENCES = ("kl", "reverse_kl", "jeffreys", "tv", "hellinger", "js")
STRICT_LAD_DIVERGENCES = ("tv", "hellinger", "js")
DPH_DIVERGENCES = ("dph_forward_kl", "dph_js", "dph_alpha")


def f_divergence(name: str, log_u: torch.Tensor, alpha: Optional[float] = None) -> torch.Tensor:
    """The generator ``f(u)`` of the named f-divergence, elementwise, from ``log u``.

    ``log_u`` is clamped to [-20, 20] first. ``alpha`` is used (and required) only by
    ``dph_alpha``. Unknown names raise ``ValueError`` listing the valid ones.
    """
    fn = _GENERATORS.get(name)
    if fn is None:
        raise unknown_name_error("divergence", name, _GENERATORS)
    lu = clamp_log(log_u)
    if name == "dph_alpha":
        return fn(lu, alpha)
    return fn(lu)

