"""Per-token KL estimators (Schulman's k1/k2/k3) between the policy and a reference.

With ``log_ratio = log pi_theta - log pi_ref`` on samples of ``pi_theta``:

* ``k1 = log_ratio`` (unbiased, high variance, can be negative)
* ``k2 = 0.5 * log_ratio^2``
* ``k3 = exp(-log_ratio) - 1 + log_ratio`` (unbiased, non-negative); this is the
  ``exp(ref - lp) - (ref - lp) - 1`` of the RKL baseline, ALGORITHMS.md section 2.
"""
from __future__ import annotations

import torch

from ._utils import check_same_shape, clamp_log, fill_masked, unknown_name_error, zero_masked

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(log_probs, ref_log_probs, mask=None, estimator: str = "k3", clamp: float = 10.0):
    """Per-token KL estimate ``[B, T]`` (zero where ``mask`` is 0).

    ``k3`` values are clamped to ``[-clamp, clamp]`` as OpenRLHF and verl do.
    """
    check_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs, mask=mask)
    lr = log_probs - ref_log_probs
    lr = clamp_log(lr if mask is None else fill_masked(lr, mask))
    if estimator == "k1":
        kl = lr
    elif estimator == "k2":
        kl = 0.5 * lr**2
    elif estimator == "k3":
        kl = ((torch.exp(-lr) - 1) + lr).clamp(-clamp, clamp)  # as the spec writes it
    else:
        raise unknown_name_error("KL estimator", estimator, KL_ESTIMATORS)
    return kl if mask is None else zero_masked(kl, mask)
