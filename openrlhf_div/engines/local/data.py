"""Minimal, tolerant JSONL datasets for the local engine, and seeded cursors over them.

A training/eval file holds one normalised example per line, ``{"prompt", "label",
"source", "id"}``; ``label``, ``source`` and ``id`` may be missing (``label`` -> None,
``source`` -> the file name, ``id`` -> ``<file stem>-<line>``), extra keys are kept, blank
lines and ``#`` comment lines are skipped. A bad line is an error naming file and line.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Sequence

import numpy as np
from openrlhf_div.io import atomic_write_jsonl


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not valid JSON ({e.msg}); each line must be one JSON object") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{ln}: expected a JSON object, got {type(obj).__name__}")
            obj["_line"] = ln
            rows.append(obj)
    return rows


def load_examples(path: str) -> List[Dict[str, Any]]:
    """Normalised examples from a JSONL file (see the module docstring)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    out = []
    for obj in read_jsonl(path):
        ln = obj.pop("_line")
        if "prompt" not in obj:
            raise ValueError(f"{path}:{ln}: example has no 'prompt' key (keys: {', '.join(sorted(obj))})")
        obj.setdefault("label", None)
        obj.setdefault("source", stem)
        obj.setdefault("id", f"{stem}-{ln}")
        obj["id"] = str(obj["id"])
        out.append(obj)
    if not out:
        raise ValueError(f"data file {path!r} holds no examples")
    return out


def write_jsonl_atomic(path: str, rows: Iterable[Dict[str, Any]]) -> None:
    """Write rows (one JSON object a line) to ``path`` atomically (:mod:`openrlhf_div.io`)."""
    atomic_write_jsonl(path, rows)


class Cursor:
    """Endless seeded stream over ``items``: each epoch is a fresh permutation drawn from
    ``numpy.random.default_rng((seed, epoch))``. The state is just ``(epoch, pos)``, so a
    resumed run continues with exactly the same items."""

    def __init__(self, items: Sequence[Any], seed: int, shuffle: bool = True):
        if len(items) == 0:
            raise ValueError("Cursor needs at least one item")
        self.items = list(items)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.items))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def next(self, k: int) -> List[Any]:
        out = []
        for _ in range(int(k)):
            if self.pos >= len(self.items):
                self.epoch += 1
                self.pos = 0
                self._perm = self._permutation(self.epoch)
            out.append(self.items[int(self._perm[self.pos])])
            self.pos += 1
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "n": len(self.items)}

    def load_state_dict(self, st: Dict[str, int]) -> None:
        if int(st.get("n", len(self.items))) != len(self.items):
            raise ValueError(f"checkpoint cursor covers {st.get('n')} items but the dataset now has "
                             f"{len(self.items)}; resume with the same data files")
        self.seed = int(st["seed"])
        self.epoch, self.pos = int(st["epoch"]), int(st["pos"])
        self._perm = self._permutation(self.epoch)


def render_prompt(task, tokenizer, example: Dict[str, Any]) -> str:
    """The prompt text of an example: the task's own rendering (chat messages go through the
    tokenizer's chat template), see :meth:`openrlhf_div.tasks.Task.render_prompt`."""
    return task.render_prompt(example, tokenizer)


def load_anchor_samples(path: str) -> List[Dict[str, Any]]:
    """D_pef rows written by `openrlhf-div presample`: each needs ``prompt_ids``,
    ``response_ids`` and ``ref_log_probs`` (one per response token)."""
    rows = read_jsonl(path)
    for r in rows:
        ln = r.pop("_line")
        for key in ("prompt_ids", "response_ids", "ref_log_probs"):
            if key not in r:
                raise ValueError(f"{path}:{ln}: anchor sample lacks {key!r}; regenerate it with `openrlhf-div presample`")
        if len(r["ref_log_probs"]) != len(r["response_ids"]):
            raise ValueError(f"{path}:{ln}: {len(r['ref_log_probs'])} ref_log_probs for "
                             f"{len(r['response_ids'])} response tokens")
    return rows
