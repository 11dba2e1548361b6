"""The on-disk format of DPH-RL's pre-sampling split, and the anchor sampler.

The same layout as the local engine's ``openrlhf-div presample`` (so either engine reads the
other's output). Plain JSON Lines; no torch, Ray or OpenRLHF import here. An output directory::

    d_pef.jsonl    near-perfect prompts, one correct response each (the anchors)
    d_exp.jsonl    the other prompts (an OpenRLHF --data.prompt_dataset as is)
    summary.json   counts, the #correct histogram and the settings
    shards/settings.json, shards/chunk_NNNNNN.json   resumable progress

A ``d_pef.jsonl`` row is the original dataset row plus::

    {"prompt_text": "<the prompt exactly as sampled (template applied)>",
     "response": "<one correct response>",
     "prompt_ids": [int, ...], "response_ids": [int, ...],
     "ref_log_probs": [float, ...],   # log pi_ref(y_t | x, y_<t), one per response id, from
                                      # the *training* forward at the rollout temperature
     "n_correct": 8, "n_pre": 8}

A ``d_exp.jsonl`` row is the original row plus ``"n_correct"`` and ``"n_pre"``.
A chunk file is ``{"chunk": c, "pef": [rows], "exp": [rows], "n_correct": [int per prompt]}``.
"""
from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence


@dataclass
class AnchorRecord:
    """One ``D_pef`` sample: a correct response and its stored base log-probs."""

    prompt_ids: List[int]
    response_ids: List[int]
    ref_log_probs: List[float]
    prompt: str = ""
    response: str = ""
    label: Any = None
    id: str = ""

    @classmethod
    def from_json(cls, d: Dict[str, Any], where: str = "") -> "AnchorRecord":
        missing = [k for k in ("prompt_ids", "response_ids", "ref_log_probs") if k not in d]
        if missing:
            raise ValueError(f"{where}: D_pef record lacks {', '.join(missing)} (write it with presample_ray)")
        rec = cls(prompt_ids=[int(t) for t in d["prompt_ids"]], response_ids=[int(t) for t in d["response_ids"]],
                  ref_log_probs=[float(x) for x in d["ref_log_probs"]],
                  prompt=d.get("prompt_text", d.get("prompt", "")),
                  response=d.get("response", ""), label=d.get("label"), id=str(d.get("id", "")))
        rec.validate(where)
        return rec

    def validate(self, where: str = "") -> None:
        if not self.prompt_ids or not self.response_ids:
            raise ValueError(f"{where}: D_pef record has an empty prompt or response")
        if len(self.response_ids) != len(self.ref_log_probs):
            raise ValueError(
                f"{where}: {len(self.response_ids)} response ids but {len(self.ref_log_probs)} "
                "ref_log_probs; they must align one to one"
            )
        bad = [x for x in self.ref_log_probs if not math.isfinite(x) or x > 1e-4]
        if bad:
            raise ValueError(f"{where}: ref_log_probs must be finite log-probabilities <= 0, got {bad[:3]}")


def _file(path: str, kind: str) -> str:
    """``path`` itself, or ``path/d_<kind>.jsonl`` for an output directory."""
    if os.path.isdir(path):
        f = os.path.join(path, f"d_{kind}.jsonl")
        if os.path.exists(f):
            return f
        if os.path.isdir(os.path.join(path, "shards")):
            raise FileNotFoundError(
                f"{path} holds an unfinished pre-sampling run (no d_{kind}.jsonl yet); rerun the same "
                "presample command to finish it"
            )
        raise FileNotFoundError(f"{path} holds no d_{kind}.jsonl; run presample_ray (or openrlhf-div presample) first")
    if os.path.exists(path):
        return path
    raise FileNotFoundError(f"D_{kind} not found at {path!r}")


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    out = []
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not valid JSON ({exc})") from None
    return out


def read_pef(path: str) -> List[AnchorRecord]:
    """All ``D_pef`` records at ``path`` (an output directory or a ``d_pef.jsonl`` file)."""
    f = _file(path, "pef")
    recs = [AnchorRecord.from_json(d, where=f"{f}:{i}") for i, d in enumerate(read_jsonl(f), 1)]
    if not recs:
        raise ValueError(f"D_pef at {path!r} is empty: no prompt reached the near-perfect threshold")
    return recs


def read_exp(path: str) -> List[Dict[str, Any]]:
    return read_jsonl(_file(path, "exp"))


class AnchorPool:
    """Draws anchor samples from ``D_pef``: shuffled epochs without replacement, seeded.

    ``draw(n)`` continues where the previous call stopped, so over a run every record is
    used once per pass through ``D_pef`` before any is repeated.
    """

    def __init__(self, records: Sequence[AnchorRecord], seed: int = 0):
        if not records:
            raise ValueError("AnchorPool needs at least one D_pef record")
        self.records = list(records)
        self.seed = int(seed)
        self.epoch = 0
        self._order: List[int] = []
        self._pos = 0
        self._reshuffle()

    def _reshuffle(self) -> None:
        self._order = list(range(len(self.records)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(self._order)
        self._pos = 0

    def draw(self, n: int) -> List[AnchorRecord]:
        out: List[AnchorRecord] = []
        while len(out) < n:
            if self._pos >= len(self._order):
                self.epoch += 1
                self._reshuffle()
            take = min(n - len(out), len(self._order) - self._pos)
            out.extend(self.records[i] for i in self._order[self._pos:self._pos + take])
            self._pos += take
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "pos": self._pos, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        self._reshuffle()
        self._pos = int(state["pos"])


def anchor_count(num_online: int, anchor_batch_size: Optional[int], ratio: float) -> int:
    """``B_pef`` for a step: the explicit size, else ``ceil(num_online / ratio)`` (at least 1),
    the local engine's rule (``ceil(rows / optim.anchor_ratio)`` per optimizer step)."""
    if anchor_batch_size is not None:
        if anchor_batch_size < 0:
            raise ValueError(f"--div.anchor_batch_size must be >= 0, got {anchor_batch_size}")
        return int(anchor_batch_size)
    if not ratio > 0:
        raise ValueError(f"--div.anchor_ratio must be > 0, got {ratio}")
    return max(1, math.ceil(num_online / ratio))
