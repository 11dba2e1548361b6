"""``model.dtype: auto``: float32 or bfloat16 (with float32 master weights) for this model on this
device, by timing the model's own matmul shapes in both (issue 32).

bfloat16 is 2-4x faster than float32 on CPUs with bfloat16 matrix units (Intel AMX, AVX512-BF16)
and on bf16 GPUs, and several times *slower* on CPUs without them (AVX2: bfloat16 is emulated), so
no fixed default fits every machine. The probe multiplies a ``[tokens, hidden]`` activation by the
model's ``[hidden, intermediate]`` and ``[hidden, hidden]`` weights in each dtype, after a
warm-up, in this process, in interleaved rounds (the fastest round of each dtype counts: robust to
other processes on a shared machine), and takes bfloat16 when it is at least :data:`MARGIN` times
faster (bfloat16 also pays the master-weight copies). Models with a hidden size below
:data:`MIN_HIDDEN` (the tiny test and demo models) stay float32 without a probe: matmuls that small
are overhead-bound, and tests stay machine-independent. The choice and both timings are printed in
one line and recorded in ``run_info.json``; the vLLM sampler follows (it takes the policy's dtype).
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional

import torch

MIN_HIDDEN = 256
MARGIN = 1.2
PROBE_TOKENS = 256
PROBE_REPS = 7  # interleaved rounds; the fastest of each dtype counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_probe(hidden: int, intermediate: int, device, tokens: int = PROBE_TOKENS,
                 reps: int = PROBE_REPS) -> Dict[str, float]:
    """Seconds of one ``x @ W1.T`` plus ``x @ W2.T`` (``x [tokens, hidden]``, ``W1 [intermediate,
    hidden]``, ``W2 [hidden, hidden]``) in float32 and bfloat16 on ``device``: ``reps`` rounds after
    a warm-up, the two dtypes alternating within each round, the **fastest** round of each dtype.
    On a shared machine another process can take the cores for part of a round; the minimum of
    interleaved rounds is what each dtype costs when it runs, and both dtypes see the same load
    (a mean of back-to-back blocks chose float32 in one run and bfloat16 in the next on the same
    AVX512-BF16 CPU at load average 6-19, issue 32)."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    ops = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dt)
        w1 = torch.randn(intermediate, hidden, generator=g).to(device=device, dtype=dt)
        w2 = torch.randn(hidden, hidden, generator=g).to(device=device, dtype=dt)
        ops[name] = (x, w1, w2)
    best = {name: float("inf") for name in ops}
    with torch.no_grad():
        for x, w1, w2 in ops.values():  # warm-up (kernel selection, packing)
            x @ w1.T, x @ w2.T
        _sync(device)
        for _ in range(max(1, int(reps))):
            for name, (x, w1, w2) in ops.items():
                t0 = time.perf_counter()
                x @ w1.T, x @ w2.T
                _sync(device)
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


PROBE = matmul_probe  # the tests replace it with a fake (no timing in tests)


def choose_dtype(model_config, device) -> Dict[str, Any]:
    """``{"dtype", "master_weights", "reason", "probe_seconds"}`` for ``model.dtype: auto``."""
    device = torch.device(device)
    hidden = int(getattr(model_config, "hidden_size", 0) or 0)
    if hidden < MIN_HIDDEN:
        return {"dtype": "float32", "master_weights": False, "probe_seconds": None,
                "reason": f"hidden size {hidden} < {MIN_HIDDEN} (a tiny model): float32 without a probe"}
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return {"dtype": "float32", "master_weights": False, "probe_seconds": None,
                "reason": "this GPU has no bfloat16 support"}
    inter = int(getattr(model_config, "intermediate_size", 0) or 4 * hidden)
    t = PROBE(hidden, inter, device)
    bf16 = t["bfloat16"] * MARGIN < t["float32"]
    return {"dtype": "bfloat16" if bf16 else "float32", "master_weights": bf16,
            "probe_seconds": {k: float(v) for k, v in t.items()},
            "reason": (f"matmul probe on {device.type} ([{PROBE_TOKENS}x{hidden}] x [{hidden}x{inter}], "
                       f"[{hidden}x{hidden}]): float32 {t['float32'] * 1e3:.2f} ms, bfloat16 "
                       f"{t['bfloat16'] * 1e3:.2f} ms (bfloat16 needs to be {MARGIN}x faster)")}


def resolve_auto_dtype(cfg, model, device, *, log=print) -> Optional[Dict[str, Any]]:
    """When ``cfg.model.dtype == "auto"``: choose (:func:`choose_dtype`) for ``model`` (loaded in
    float32), write the choice into ``cfg.model`` (so the saved config and a resume use it) and
    print it in one line; returns the choice (None when the dtype was given)."""
    m = cfg.model
    if m.dtype != "auto":
        return None
    choice = choose_dtype(model.config, device)
    m.dtype = choice["dtype"]
    m.master_weights = bool(choice["master_weights"] or (m.master_weights and m.dtype == "bfloat16"))
    log(f"[openrlhf-div] model.dtype=auto: {m.dtype}"
        + (" (float32 master weights)" if m.master_weights else "") + f" - {choice['reason']}")
    return choice
