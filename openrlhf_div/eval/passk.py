"""Unbiased pass@k and mean@k (ALGORITHMS.md section 6)."""
from __future__ import annotations

import numpy as np


def _as_counts(name, arr, orig):
    """``arr`` as int64 counts; refuses fractional, non-finite or non-numeric values."""
    a = np.atleast_1d(arr)
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    if a.dtype.kind in "bf":
        af = a.astype(np.float64)
        if np.all(np.isfinite(af)) and np.all(af == np.floor(af)):
            return af.astype(np.int64)
    raise ValueError(f"pass_at_k: {name} must hold whole numbers (sample counts), got {name}={orig!r}")


def pass_at_k(n, c, k):
    """Unbiased pass@k estimate ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021).

    Computed as ``1 - prod_{i=n-c+1..n} (1 - k/i)``, which is exact (no huge binomials)
    for ``n`` up to 1e5. ``n``, ``c`` and ``k`` may be Python ints or numpy arrays that
    broadcast together; a scalar input returns a Python float, an array input an array.

    Raises ``ValueError`` unless ``0 <= c <= n`` and ``1 <= k <= n`` are whole numbers.
    """
    n_a, c_a, k_a = np.broadcast_arrays(np.asarray(n), np.asarray(c), np.asarray(k))
    scalar = n_a.ndim == 0
    n_a, c_a, k_a = (_as_counts(nm, v, orig) for nm, v, orig in
                     (("n", n_a, n), ("c", c_a, c), ("k", k_a, k)))
    if np.any(c_a < 0) or np.any(c_a > n_a):
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n!r}, c={c!r}")
    if np.any(k_a < 1) or np.any(k_a > n_a):
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n!r}, k={k!r}")
    out = np.empty(n_a.shape, dtype=np.float64)
    for idx in np.ndindex(n_a.shape):
        nn, cc, kk = int(n_a[idx]), int(c_a[idx]), int(k_a[idx])
        if nn - cc < kk:  # every k-subset holds a correct sample
            out[idx] = 1.0
            continue
        i = np.arange(nn - cc + 1, nn + 1, dtype=np.float64)
        # log-space product keeps precision for long products
        out[idx] = -np.expm1(np.sum(np.log1p(-kk / i))) + 0.0
    if scalar:
        return float(out[0])
    return out


def mean_at_k(correct) -> float:
    """mean@k: the mean accuracy of the ``k`` samples of each problem, averaged over problems.

    ``correct`` is a ``[P, k]`` array (or list of lists) of 0/1 outcomes.
    """
    arr = np.asarray(correct, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"mean_at_k: expected a [problems, k] array of 0/1, got shape {arr.shape}")
    return float(arr.mean())
