"""The demo's base model: a supervised warm-up that makes a tiny model multimodal and imperfect.

A freshly initialised tiny Qwen2 (:mod:`openrlhf_div.engines.local.tiny`) is trained with
plain next-token cross-entropy on *synthetic* demo data: prompt ``"N ="`` (``N`` uniform
in 100..999), response = the correct answer of ``N`` in a style drawn from
``style_weights`` (default A/B/C/D/E at 35/25/20/12/8 %), then ``<eos>``. A deliberate error
(one changed digit, :func:`openrlhf_div.tasks.demo.mutate`) replaces the answer with
probability

    p_err(N, s) = err_easy            if N < easy_below    (default 3 %, below 300)
                  err_by_style[s]     otherwise            (default 45/52/60/68/75 %)

so the rarer styles are also less reliable. The model learns the *distribution*: it samples
every style, answers small ``N`` almost always right and large ``N`` often wrong, so its
pass@1 is well below its pass@16 and RL has something to improve; the near-perfect small
``N`` give DPH its ``D_pef`` anchors. Nothing is downloaded.

The loss is ``-mean_t log pi(y_t | x, y_<t)`` over response tokens (``<eos>`` included),
computed with the engine's training forward (:func:`~openrlhf_div.engines.local.generation.response_forward`)
so warm-up and RL see identical inputs. The result is cached on disk under a directory
named by a hash of :class:`WarmupConfig` (and :data:`DATA_VERSION`): :func:`build_base_model`
rebuilds only when a setting changes, and saves atomically (``save_model``).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..tasks.demo import N_MAX, N_MIN, STYLES, mutate, prompt_text, render

#: bump when the synthetic-data recipe changes (invalidates cached base models)
DATA_VERSION = 1
VOCAB = "0123456789ABCDE+-/= "
META_FILE = "warmup.json"


@dataclass(frozen=True)
class WarmupConfig:
    """Everything that determines the base model (the cache key)."""

    seed: int = 0
    # model (tiny Qwen2)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    # synthetic data
    style_weights: Tuple[float, ...] = (0.35, 0.25, 0.20, 0.12, 0.08)
    easy_below: int = 300
    err_easy: float = 0.03
    err_by_style: Tuple[float, ...] = (0.45, 0.52, 0.60, 0.68, 0.75)
    # optimisation
    steps: int = 600
    batch_size: int = 256
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0

    def __post_init__(self):
        for name in ("style_weights", "err_by_style"):
            v = tuple(float(x) for x in getattr(self, name))
            if len(v) != len(STYLES):
                raise ValueError(f"WarmupConfig.{name} needs {len(STYLES)} values (styles {''.join(STYLES)}), got {v}")
            object.__setattr__(self, name, v)
        if any(w < 0 for w in self.style_weights) or sum(self.style_weights) <= 0:
            raise ValueError(f"WarmupConfig.style_weights must be >= 0 with a positive sum, got {self.style_weights}")
        for p in (self.err_easy,) + self.err_by_style:
            if not 0 <= p <= 1:
                raise ValueError(f"WarmupConfig error rates must be in [0, 1], got {p}")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"WarmupConfig.steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "WarmupConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown warm-up setting(s) {bad}; valid: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["style_weights"] = list(self.style_weights)
        d["err_by_style"] = list(self.err_by_style)
        return d

    def key(self) -> str:
        """A short hash of the settings and the data recipe version: the cache directory name."""
        blob = json.dumps({"v": DATA_VERSION, "vocab": VOCAB, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def error_rate(self, n: int, style: str) -> float:
        return self.err_easy if n < self.easy_below else self.err_by_style[STYLES.index(style)]


def synthetic_examples(cfg: WarmupConfig, rng: random.Random, count: int) -> List[Tuple[str, str]]:
    """``count`` (prompt, response) pairs of the warm-up distribution (see the module doc)."""
    out = []
    for _ in range(count):
        n = rng.randint(N_MIN, N_MAX)
        style = rng.choices(STYLES, weights=cfg.style_weights)[0]
        resp = render(n, style)
        if rng.random() < cfg.error_rate(n, style):
            resp = mutate(resp, rng)
        out.append((prompt_text(n), resp))
    return out


def expected_accuracy(cfg: WarmupConfig, ns: Sequence[int]) -> float:
    """The accuracy a perfect imitator of the warm-up data would have on ``ns``."""
    w = [x / sum(cfg.style_weights) for x in cfg.style_weights]
    return sum(sum(wi * (1 - cfg.error_rate(n, s)) for wi, s in zip(w, STYLES)) for n in ns) / len(ns)


def default_cache_dir() -> str:
    """``$OPENRLHF_DIV_CACHE`` or ``$XDG_CACHE_HOME/openrlhf-div`` (``~/.cache/openrlhf-div``)."""
    if os.environ.get("OPENRLHF_DIV_CACHE"):
        return os.environ["OPENRLHF_DIV_CACHE"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "openrlhf-div")


def base_model_dir(cfg: WarmupConfig, cache_dir: Optional[str] = None) -> str:
    return os.path.join(cache_dir or default_cache_dir(), "demo-base", cfg.key())


def _lr_at(step: int, cfg: WarmupConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train_base_model(cfg: WarmupConfig, progress: bool = True, log: Callable[[str], None] = print):
    """``(model, tokenizer, stats)``: build the tiny model and run the warm-up (no caching)."""
    from ..engines.local.generation import pack_sequences, response_forward
    from ..engines.local.tiny import build_tiny_model

    model, tok = build_tiny_model(VOCAB, seed=cfg.seed, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                                  num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                  max_position_embeddings=64)
    vocab = tok.get_vocab()
    eos = tok.eos_token_id

    def ids(s: str) -> List[int]:
        return [vocab[ch] for ch in s]

    rng = random.Random(f"demo-warmup-{cfg.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    model.train()
    t0 = time.time()
    from openrlhf_div.progress import progress_bar

    bar = progress_bar(total=cfg.steps, desc="warm-up (supervised)", unit="step", leave=False, disable=not progress)
    losses: List[float] = []
    for step in range(cfg.steps):
        batch = synthetic_examples(cfg, rng, cfg.batch_size)
        p_ids = [ids(p) for p, _ in batch]
        r_ids = [ids(r) + [eos] for _, r in batch]
        inp, attn, rmask = pack_sequences(p_ids, r_ids, tok.pad_token_id)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        lp = response_forward(model, inp, attn, rmask).log_probs
        loss = -(lp * rmask).sum() / rmask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if bar is not None:
            bar.update(1)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
    if bar is not None:
        bar.close()
    model.eval()
    stats = {"final_loss": sum(losses[-50:]) / min(50, len(losses)), "seconds": time.time() - t0,
             "loss_curve": [round(sum(losses[i:i + 50]) / len(losses[i:i + 50]), 4)
                            for i in range(0, len(losses), 50)]}
    return model, tok, stats


def build_base_model(cfg: WarmupConfig = WarmupConfig(), cache_dir: Optional[str] = None, *,
                     progress: bool = True, log: Callable[[str], None] = print, force: bool = False) -> str:
    """The cached base-model directory for ``cfg``: reused when present, else trained and
    saved atomically (model + tokenizer + ``warmup.json`` with the settings and stats)."""
    from ..engines.local.models import save_model

    path = base_model_dir(cfg, cache_dir)
    meta = os.path.join(path, META_FILE)
    if not force and os.path.isfile(meta):
        with open(meta) as f:
            saved = json.load(f)
        if saved.get("config") == cfg.to_dict() and saved.get("data_version") == DATA_VERSION:
            log(f"base model: cached at {path}")
            return path
    log(f"base model: warm-up of a tiny Qwen2 ({cfg.num_layers} layers, width {cfg.hidden_size}) for "
        f"{cfg.steps} steps x {cfg.batch_size} synthetic sequences ...")
    model, tok, stats = train_base_model(cfg, progress=progress, log=log)
    save_model(model, tok, path)
    # The metadata goes last (atomically): a directory without it is never taken as a cache hit.
    from ..eval.results import atomic_write_json

    atomic_write_json(meta, {"config": cfg.to_dict(), "data_version": DATA_VERSION, "key": cfg.key(),
                             "stats": stats})
    log(f"base model: trained in {stats['seconds']:.0f} s (final loss {stats['final_loss']:.3f}), saved to {path}")
    return path
