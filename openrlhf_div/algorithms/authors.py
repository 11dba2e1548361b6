"""The papers' published code, where it weights, aggregates or gates differently from the
spec's clean form (docs/ALGORITHMS.md, "Paper text vs authors' code vs this library").

Pure torch. Each helper here is one option a method can switch to ("as the authors ran it");
the presets say which one they use and why (``openrlhf-div methods NAME``):

* :func:`anchor_weight` -- ``anchor_weighting``: ``token_mean`` (the spec, ``L_exp + eta L_pef``)
  or ``microbatch_share`` (seamoke/DPH-RL: whole micro-batches go to the anchor or the online
  loss and every micro-batch is divided by the same accumulation count, so the anchor weighs
  ``eta x #anchor micro-batches / #online micro-batches`` -- ``eta / 8`` at 2048 : 256).
* :func:`micro_batch_token_mean` -- aggregation ``micro-batch-token-mean``: token-mean inside
  groups of ``micro_batch_seqs`` consecutive sequences, then the mean over groups (verl's
  ``agg_loss(token-mean)`` applied per micro-batch and divided by ``gradient_accumulation``).
* :func:`js_def_online_gate` -- ``js_def_online: stochastic``: the online half of the
  divergence-definition JS applied with weight ``eta`` to a micro-batch when
  ``randint(1, 10) <= js_ratio`` (the authors' ``random.randint``), instead of ``eta x lambda``
  on every micro-batch.
* :func:`clamp_k3` -- ``js_def_clamp``: verl's ``kl_penalty(low_var_kl)`` clamps the k3 value to
  ``[-10, 10]`` (zero gradient beyond).
* :class:`AuthorsLogZHead` -- FlowRL ``log_z_head: authors``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._utils import check_same_shape, fill_masked, unknown_name_error

ANCHOR_WEIGHTINGS = ("token_mean", "microbatch_share")
JS_DEF_ONLINE_MODES = ("fixed", "stochastic")
LOG_Z_HEADS = ("small_detached", "authors")
MICRO_BATCH_TOKEN_MEAN = "micro-batch-token-mean"


def anchor_weight(eta: float, mode: str = "token_mean", *, num_online_seqs: Optional[float] = None,
                  num_anchor_seqs: Optional[float] = None) -> float:
    """The weight of ``L_pef`` next to ``L_exp`` in one optimiser step.

    ``token_mean``: ``eta``. ``microbatch_share``: ``eta * num_anchor_seqs / num_online_seqs`` --
    with micro-batches of equal size on both sides this is the authors' ``eta x #anchor
    micro-batches / #online micro-batches`` (``eta / 8`` for 256 anchors next to 128 x 16
    rollouts). Needs both counts (the optimiser step's, over all ranks); with no online rows the
    anchor part keeps ``eta`` (nothing to share with)."""
    if mode not in ANCHOR_WEIGHTINGS:
        raise unknown_name_error("anchor_weighting", mode, ANCHOR_WEIGHTINGS)
    eta = float(eta)
    if mode == "token_mean":
        return eta
    if num_online_seqs is None or num_anchor_seqs is None:
        raise ValueError("anchor_weighting='microbatch_share' needs num_online_seqs and num_anchor_seqs "
                         "(the optimiser step's online and anchor sequence counts)")
    if float(num_online_seqs) <= 0:
        return eta
    return eta * float(num_anchor_seqs) / float(num_online_seqs)


def micro_batch_token_mean(loss: torch.Tensor, mask: torch.Tensor, micro_batch_seqs: int = 2,
                           num_seqs: Optional[float] = None, masked_zero: bool = False) -> torch.Tensor:
    """Token-mean inside each group of ``micro_batch_seqs`` (``k``) consecutive rows, each group
    weighted ``k / num_seqs`` (``num_seqs``: the optimiser step's sequence count, default the rows
    here) -- verl's ``loss / gradient_accumulation`` with ``gradient_accumulation = mini-batch rows
    // k``, so a trailing partial group weighs as much as a full one, as there. With full groups
    this is the mean over groups of their token-means. A group with no valid token contributes 0."""
    check_same_shape("loss", loss, mask=mask)
    k = int(micro_batch_seqs)
    if k < 1:
        raise ValueError(f"micro_batch_seqs must be >= 1, got {micro_batch_seqs}")
    m = mask.to(loss.dtype)
    lm = loss if masked_zero else fill_masked(loss, mask)
    B = loss.shape[0]
    pad = (-B) % k
    seq_sum, seq_tok = lm.sum(dim=1), m.sum(dim=1)
    if pad:
        seq_sum = torch.cat([seq_sum, seq_sum.new_zeros(pad)])
        seq_tok = torch.cat([seq_tok, seq_tok.new_zeros(pad)])
    g_sum, g_tok = seq_sum.view(-1, k).sum(1), seq_tok.view(-1, k).sum(1)
    per_group = g_sum / g_tok.clamp(min=1.0)
    n = float(B if num_seqs is None else num_seqs)
    return per_group.sum() * (k / max(n, 1.0))


def micro_batch_token_weights(lengths: torch.Tensor, micro_batch_seqs: int = 2) -> torch.Tensor:
    """Per-sequence weight of one token under :func:`micro_batch_token_mean` (rows in order):
    ``(k / #sequences) / tokens of its micro-batch``. The step's token-mean gives every token
    ``1 / sum(lengths)``."""
    L = torch.as_tensor(lengths, dtype=torch.float64)
    k = int(micro_batch_seqs)
    group_tok = torch.stack([L[i:i + k].sum() for i in range(0, L.numel(), k)])
    return (k / L.numel()) / group_tok.repeat_interleave(k)[:L.numel()]


def js_def_online_gate(generator: torch.Generator, js_ratio: int = 1) -> bool:
    """The authors' draw ``random.randint(1, 10) <= js_ratio`` (per micro-batch), from a seeded
    ``torch.Generator`` so a run is reproducible and resumable."""
    draw = int(torch.randint(1, 11, (1,), generator=generator))
    return draw <= int(js_ratio)


def clamp_k3(value: torch.Tensor, bound: float = 10.0) -> torch.Tensor:
    """verl's clamp of the k3 value to ``[-bound, bound]`` (gradient 0 where it engages)."""
    return value.clamp(-float(bound), float(bound))


class AuthorsLogZHead(torch.nn.Module):
    """FlowRL's log Z head as its authors built it (Xuekai-Zhu/FlowRL, ``ProjZModule`` with
    ``porj_layer=3``): ``[Linear(H, H) - GELU - LayerNorm - Dropout(0.1)] x (layers - 1) +
    Linear(H, 1)`` on the mean prompt hidden state, **not** detached (its loss also trains the
    trunk). ``[B, H] -> [B]``."""

    def __init__(self, hidden_size: int, num_layers: int = 3, dropout: float = 0.1):
        super().__init__()
        blocks = []
        for _ in range(int(num_layers) - 1):
            blocks += [torch.nn.Linear(hidden_size, hidden_size), torch.nn.GELU(),
                       torch.nn.LayerNorm(hidden_size), torch.nn.Dropout(dropout)]
        blocks.append(torch.nn.Linear(hidden_size, 1))
        self.net = torch.nn.Sequential(*blocks)

    def forward(self, prompt_hidden: torch.Tensor) -> torch.Tensor:
        return self.net(prompt_hidden.float()).squeeze(-1)


# ------------------------------------------------------------------ what `methods NAME` prints
# option -> (the spec's value, the authors' code's value, source). The presets keep the spec's
# value unless they say otherwise; `openrlhf-div methods NAME` shows each option a method has,
# its value and which side it follows (docs/ALGORITHMS.md section 9, rows in brackets).
AUTHORS_OPTIONS = {
    "anchor_weighting": ("token_mean", "microbatch_share",
                         "[1] seamoke/DPH-RL verl/workers/actor/dp_actor.py update_policy: whole micro-batches "
                         "routed by data['type'][0], each divided by gradient_accumulation -> eta x #anchor / "
                         "#online micro-batches (eta/8 at 2048:256)"),
    "aggregation": ("token-mean", MICRO_BATCH_TOKEN_MEAN,
                    "[2] seamoke/DPH-RL dp_actor.py update_policy + core_algos.agg_loss('token-mean') per "
                    "micro-batch of ppo_micro_batch_size_per_gpu=2 (scripts/llama/forward_kl.sh)"),
    "micro_batch_seqs": (2, 2, "[2] scripts/llama/*.sh ppo_micro_batch_size_per_gpu=2"),
    "js_def_clamp": (None, 10.0, "[3a] seamoke/DPH-RL verl/trainer/ppo/core_algos.py kl_penalty('low_var_kl'): "
                                 "k3 clamped to [-10, 10]"),
    "js_def_online": ("fixed", "stochastic", "[3b] seamoke/DPH-RL dp_actor.py update_policy: "
                                            "random.randint(1, 10) <= js_ratio, weight sft_loss_coeff"),
    "js_def_ratio": (1, 1, "[3b] seamoke/DPH-RL verl/trainer/config/ppo_trainer.yaml js_ratio: 1"),
    "lad_clip": (None, (0.2, 0.28), "[6a] LAD paper App. C.2: DAPO clip-higher for every method"),
    "lad_hellinger_half": (True, False, "[6b] LAD paper Table 5 loss column (no 1/2; generator has it)"),
    "log_z_head": ("small_detached", "authors", "[7a] Xuekai-Zhu/FlowRL verl/workers/fsdp_workers.py ProjZModule "
                                                "(porj_layer=3), not detached"),
    "flowrl_max_weight": (10.0, None, "[7b] Xuekai-Zhu/FlowRL dp_actor.py compute_flowrl_objective multiplies by "
                                      "the unclipped importance weight"),
    "ds_granularity": ("token", "seq_sum", "[8a] Differential Smoothing paper Eq. 6 (sequence log-probability; "
                                           "no public code)"),
    "kl_cov_min_one": (False, True, "[9c] volcengine/verl core_algos.py compute_policy_loss_kl_cov: "
                                    "max(1, int(N * ratio))"),
    "eps_low": (None, None, ""), "eps_high": (None, None, ""), "dual_clip": (None, None, ""),
}
# the authors' PPO clip where it differs from the presets', per method: (eps_low, eps_high, dual_clip)
AUTHORS_CLIP = {
    "clip_cov": ((1.0, 1.0, None), "[5] PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/7b_clip_cov.sh clip_ratio 1 / 1; "
                                   "compute_policy_loss_clip_cov has no dual clip"),
    "cispo": ((10.0, 0.2, None), "[9b] volcengine/verl examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh "
                                 "clip_ratio_low 10, clip_ratio_high 0.2"),
}


# per preset: hyperparameters whose value in the authors' published scripts differs from the
# preset's (which follows the paper's text): name -> {hparam: (authors' value, source)}
AUTHORS_SCRIPT_VALUES = {
    "dph_js": {"anchor_eta": (0.01, "[4e] seamoke/DPH-RL scripts/llama/js_kl.sh sft_loss_coeff=${2:-'0.01'} "
                                    "(paper Table 5: 0.2)")},
    "dph_alpha": {"anchor_alpha": (0.2, "[4e] seamoke/DPH-RL scripts/llama/alpha.sh alpha_coeff=${3:-'0.2'}")},
}


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def authors_modes(method) -> dict:
    """For each spec-vs-authors option a method has: its value, the spec's and the authors'
    value, which one it follows (``spec`` / ``authors`` / ``both`` / ``other``) and the source."""
    h = dict(getattr(method, "hparams", {}) or {})
    h["aggregation"] = getattr(method, "aggregation", "token-mean")
    out = {}
    for opt, (spec, auth, src) in AUTHORS_OPTIONS.items():
        if opt in ("eps_low", "eps_high", "dual_clip") or opt not in h:
            continue
        if opt == "micro_batch_seqs" and h["aggregation"] != MICRO_BATCH_TOKEN_MEAN:
            continue
        if opt == "aggregation" and h["aggregation"] not in (spec, auth):
            continue  # a method whose own aggregation is neither (FlowRL's sequence mean)
        v = h[opt]
        follows = ("both" if _same(v, spec) and _same(v, auth) else "spec" if _same(v, spec)
                   else "authors" if _same(v, auth) else "other")
        out[opt] = {"value": v, "spec": spec, "authors": auth, "follows": follows, "source": src}
    for opt, (auth, src) in AUTHORS_SCRIPT_VALUES.get(getattr(method, "name", ""), {}).items():
        if opt in h:
            out[opt] = {"value": h[opt], "spec": "the preset's (paper text)", "authors": auth,
                        "follows": "authors" if _same(h[opt], auth) else "spec", "source": src}
    clip = AUTHORS_CLIP.get(getattr(method, "policy_loss", None))
    if clip is not None and all(k in h for k in ("eps_low", "eps_high", "dual_clip")):
        v = (h["eps_low"], h["eps_high"], h["dual_clip"])
        out["eps_low/eps_high/dual_clip"] = {"value": v, "spec": "the preset's", "authors": clip[0],
                                             "follows": "authors" if _same(v, clip[0]) else "spec",
                                             "source": clip[1]}
    return out


def mode_summary(method) -> str:
    """One line for reports: which form the method runs in (the spec's clean form, the authors'
    code, or a mix) and the options' values."""
    modes = authors_modes(method)
    if not modes:
        return "the spec's form (no authors'-code option applies)"
    sides = {m["follows"] for m in modes.values()} - {"both"}
    kind = ("the spec's clean form" if sides <= {"spec"} else "the authors' code" if sides == {"authors"}
            else "mixed")
    return kind + ": " + ", ".join(f"{k}={m['value']}" for k, m in modes.items())
