"""DPH-RL's anchor data, once for every engine (ALGORITHMS.md section 4).

What :meth:`~openrlhf_div.algorithms.registry.Method.rollout` is for rollouts, this module is
for ``D_pef`` / ``D_exp``: the local engine (``openrlhf-div presample``, the local trainer), the
OpenRLHF engine (``presample_ray``, the experience maker) and the Megatron actor (which trains
on the OpenRLHF experience maker's batches) all use these functions; each engine only supplies
the samples (its own sampler) and the base log-probs (its own training forward). No torch, Ray
or OpenRLHF import here (numpy only).

* **The split rule** (:func:`split_chunk`): a prompt is near-perfect when ``#correct >= tau``
  (and at least one is correct); it goes to ``D_pef`` with its *first* correct sample, or, with
  ``resample_anchor_responses`` (the authors' ``generate_sft``), with one fresh draw kept only if
  correct (a near-perfect prompt whose fresh draw fails has no anchor and is not in ``D_exp``
  either); every other prompt goes to ``D_exp`` (those with 0 correct left out with
  ``drop_unsolved``).
* **The record format**, reader and writer (:class:`AnchorRecord`, :func:`read_pef`,
  :func:`read_exp`, :class:`ShardStore`). An output directory::

      d_pef.jsonl    near-perfect prompts, one correct response each (the anchors)
      d_exp.jsonl    the other prompts (the online training set)
      summary.json   counts, the #correct histogram and the settings
      shards/settings.json, shards/chunk_NNNNNN.json   resumable progress

  A ``d_pef.jsonl`` row is the original dataset row plus::

      {"prompt_text": "<the prompt exactly as sampled (template applied)>",
       "response": "<one correct response>",
       "prompt_ids": [int, ...], "response_ids": [int, ...],
       "n_correct": 8, "n_pre": 8,
       "ref_log_probs": [float, ...]}  # log pi_ref(y_t | x, y_<t), one per response id, from
                                       # the *training* forward at the rollout temperature

  A ``d_exp.jsonl`` row is the original row plus ``"n_correct"`` and ``"n_pre"``. A chunk file is
  ``{"chunk": c, "pef": [rows], "exp": [rows], "n_correct": [int per prompt]}``.
* **The anchor sampler** (:class:`Cursor`, alias :data:`AnchorSampler`): shuffled epochs without
  replacement, each epoch's permutation drawn from ``numpy.random.default_rng((seed, epoch))``;
  the state is ``(epoch, pos)``, so a resumed run draws what an unbroken one would.
  :func:`anchor_count` is the number of anchors per step.
* **The summary** (:meth:`ShardStore.assemble`, :func:`format_summary`) and the guards around it
  (:func:`empty_anchor_message`, :func:`check_anchor_temperature`).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from openrlhf_div.io import atomic_write_json, atomic_write_jsonl

_RECORD_KEYS = ("prompt_ids", "response_ids", "ref_log_probs")
_CHUNK_KEYS = ("chunk", "pef", "exp", "n_correct")


# ------------------------------------------------------------------ the split rule
@dataclass
class Sample:
    """One sampled response: token ids, text, the task reward and (when the engine's task says
    so directly) whether it is correct; without ``correct``, ``reward >= correct_threshold``."""

    response_ids: List[int]
    text: str
    reward: float = 0.0
    correct: Optional[bool] = None

    def is_correct(self, threshold: float = 1.0) -> bool:
        return bool(self.correct) if self.correct is not None else self.reward >= threshold


def near_perfect(samples: Sequence[Sequence[Sample]], tau: int, correct_threshold: float = 1.0) -> List[int]:
    """Indices of the prompts whose ``#correct >= tau`` (and at least one correct): the prompts
    that get an anchor (and, with ``resample_anchor_responses``, a fresh draw)."""
    return [i for i, group in enumerate(samples)
            if sum(s.is_correct(correct_threshold) for s in group) >= max(int(tau), 1)]


def split_chunk(rows: Sequence[Dict[str, Any]], prompt_texts: Sequence[str], prompt_ids: Sequence[List[int]],
                samples: Sequence[Sequence[Sample]], *, n_pre: int, tau: int, drop_unsolved: bool,
                correct_threshold: float = 1.0, fresh: Optional[Sequence[Optional[Sample]]] = None,
                ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], List[int]]:
    """Split one chunk of prompts by the DPH rule (see the module docstring).

    Returns ``(pef, exp, n_correct)``: ``pef`` rows (without ``ref_log_probs``: the engine's
    training forward adds them) in prompt order, ``exp`` rows in prompt order, ``#correct`` per
    prompt. ``fresh``: one fresh draw per prompt (``None`` where none was drawn), for
    ``resample_anchor_responses``.
    """
    if not 1 <= tau <= n_pre:
        raise ValueError(f"tau must be in [1, n_pre={n_pre}], got {tau}")
    if fresh is not None and len(fresh) != len(samples):
        raise ValueError(f"fresh has {len(fresh)} entries for {len(samples)} prompts")
    pef, exp, counts = [], [], []
    for p, (row, text, pids, group) in enumerate(zip(rows, prompt_texts, prompt_ids, samples)):
        if len(group) != n_pre:
            raise ValueError(f"prompt {row.get('id', text[:40])!r}: {len(group)} samples, expected n_pre={n_pre}")
        correct = [s.is_correct(correct_threshold) for s in group]
        c = int(sum(correct))
        counts.append(c)
        if c >= tau and c > 0:
            s = group[correct.index(True)]
            if fresh is not None:
                s = fresh[p]
                if s is None or not s.is_correct(correct_threshold):
                    continue
            pef.append({**row, "prompt_text": text, "response": s.text, "prompt_ids": [int(t) for t in pids],
                        "response_ids": [int(t) for t in s.response_ids], "n_correct": c, "n_pre": n_pre})
        elif not (drop_unsolved and c == 0):
            exp.append({**row, "n_correct": c, "n_pre": n_pre})
    return pef, exp, counts


# ------------------------------------------------------------------ files: chunks, assembly, summary
class ShardStore:
    """Resumable chunk files under ``out_dir/shards`` and the final assembled files.

    ``settings`` are written to ``shards/settings.json`` on the first run; a rerun with other
    settings is refused (``hint`` names the engine's way out). A chunk file that is truncated
    or unreadable (chunks are written atomically, so only outside damage does this) is named
    in a warning, deleted and counted as still to do."""

    def __init__(self, out_dir: str, settings: Dict[str, Any], n_prompts: int, overwrite: bool = False,
                 *, engine: Optional[str] = None,
                 hint: str = "use another output directory or overwrite it"):
        self.out_dir = os.path.abspath(out_dir)
        self.shard_dir = os.path.join(self.out_dir, "shards")
        self.settings = json.loads(json.dumps(settings, default=str))
        self.n_prompts = int(n_prompts)
        self.chunk_size = int(settings["chunk_size"])
        self.engine = engine
        if overwrite and os.path.isdir(self.out_dir):
            shutil.rmtree(self.out_dir)
        os.makedirs(self.shard_dir, exist_ok=True)
        path = os.path.join(self.shard_dir, "settings.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                old = json.load(fh)
            if old != self.settings:
                diff = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
                raise ValueError(f"{self.out_dir} holds a pre-sampling run with different settings "
                                 f"({', '.join(diff)}); {hint}")
        else:
            atomic_write_json(path, self.settings, ensure_ascii=False, indent=1, sort_keys=True)

    @property
    def n_chunks(self) -> int:
        return (self.n_prompts + self.chunk_size - 1) // self.chunk_size

    def chunk_path(self, c: int) -> str:
        return os.path.join(self.shard_dir, f"chunk_{c:06d}.json")

    def bounds(self, c: int) -> Tuple[int, int]:
        return c * self.chunk_size, min((c + 1) * self.chunk_size, self.n_prompts)

    def read_chunk(self, c: int) -> Optional[Dict[str, Any]]:
        """Chunk ``c``'s contents, or None when it is absent (or was damaged: then named and deleted)."""
        path = self.chunk_path(c)
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                res = json.load(f)
            if not isinstance(res, dict) or any(k not in res for k in _CHUNK_KEYS):
                raise ValueError(f"missing keys (expected {', '.join(_CHUNK_KEYS)})")
            return res
        except (OSError, ValueError) as exc:
            print(f"[openrlhf-div] warning: pre-sampling chunk {path} is truncated or unreadable "
                  f"({type(exc).__name__}: {exc}); recomputing it")
            os.remove(path)
            return None

    def todo(self) -> List[int]:
        return [c for c in range(self.n_chunks) if self.read_chunk(c) is None]

    def write_chunk(self, c: int, pef: List[Dict], exp: List[Dict], n_correct: List[int]) -> None:
        atomic_write_json(self.chunk_path(c), {"chunk": c, "pef": pef, "exp": exp, "n_correct": n_correct},
                          ensure_ascii=False, indent=1, sort_keys=True, default=str)

    def assemble(self) -> Dict[str, Any]:
        """Write ``d_pef.jsonl``, ``d_exp.jsonl`` and ``summary.json`` from all chunks (in order)
        and return the summary."""
        chunks = [self.read_chunk(c) for c in range(self.n_chunks)]
        missing = [c for c, res in enumerate(chunks) if res is None]
        if missing:
            raise RuntimeError(f"{len(missing)} chunk(s) still to sample (first: {missing[0]}); rerun the command")
        n_pre = int(self.settings["n_pre"])
        pef, exp, hist = [], [], [0] * (n_pre + 1)
        for res in chunks:
            pef += res["pef"]
            exp += res["exp"]
            for k in res["n_correct"]:
                hist[int(k)] += 1
        atomic_write_jsonl(os.path.join(self.out_dir, "d_pef.jsonl"), pef)
        atomic_write_jsonl(os.path.join(self.out_dir, "d_exp.jsonl"), exp)
        summary = summarize(hist, n_pef=len(pef), n_exp=len(exp), n_prompts=self.n_prompts, settings=self.settings)
        summary["output_dir"] = self.out_dir
        if self.engine:
            summary["engine"] = self.engine
        atomic_write_json(os.path.join(self.out_dir, "summary.json"), summary, ensure_ascii=False, indent=1,
                          sort_keys=True, default=str)
        return summary


def summarize(hist: Sequence[int], *, n_pef: int, n_exp: int, n_prompts: int, settings: Dict[str, Any]
              ) -> Dict[str, Any]:
    """The pre-sampling summary: counts, the ``#correct`` histogram, the mean correct rate and
    the settings (``n_resample_failed``: near-perfect prompts whose fresh draw failed)."""
    n_pre, tau = int(settings["n_pre"]), int(settings["tau"])
    extra = {}
    if settings.get("resample_anchor_responses"):
        extra["n_resample_failed"] = sum(hist[max(tau, 1):]) - n_pef
    return {"complete": True, "n_prompts": n_prompts, "n_pef": n_pef, "n_exp": n_exp,
            "n_dropped_unsolved": hist[0] if settings.get("drop_unsolved") else 0, **extra,
            "correct_histogram": list(hist),
            "mean_correct_rate": float(sum(k * v for k, v in enumerate(hist)) / max(1, n_pre * n_prompts)),
            **{k: v for k, v in settings.items() if k != "n_examples"}}


def format_summary(s: Dict[str, Any]) -> str:
    """The summary as the few lines both pre-sampling commands print."""
    if not s.get("complete"):
        return (f"pre-sampling paused: {s['chunks_done']}/{s['chunks_total']} chunks done in {s['output_dir']} "
                "(run the same command again to continue)")
    n = max(1, s["n_prompts"])
    lines = [
        f"pre-sampling done: {s['n_prompts']} prompts x {s['n_pre']} samples (T={s['temperature']}), "
        f"near-perfect = #correct >= {s['tau']}",
        f"  D_pef (anchor): {s['n_pef']:6d} prompts ({100 * s['n_pef'] / n:.1f}%)",
        f"  D_exp (online): {s['n_exp']:6d} prompts ({100 * s['n_exp'] / n:.1f}%)"
        + (f", {s['n_dropped_unsolved']} unsolved dropped" if s.get("drop_unsolved") else ""),
        "  #correct histogram: " + " ".join(f"{k}:{v}" for k, v in enumerate(s["correct_histogram"])),
        f"  files: {s['output_dir']}/d_pef.jsonl, d_exp.jsonl, summary.json",
    ]
    if s.get("resample_anchor_responses"):
        lines.insert(2, f"  anchor responses drawn afresh (n=1, kept if correct): {s['n_resample_failed']} "
                        "near-perfect prompt(s) lost their anchor")
    return "\n".join(lines)


# ------------------------------------------------------------------ records and readers
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
        missing = [k for k in _RECORD_KEYS if k not in d]
        if missing:
            raise ValueError(f"{where}: D_pef record lacks {', '.join(missing)}; regenerate it with "
                             "`openrlhf-div presample` (or presample_ray)")
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


def pef_file(path: str, kind: str = "pef") -> str:
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
        raise FileNotFoundError(f"{path} holds no d_{kind}.jsonl; run `openrlhf-div presample` (or presample_ray) "
                                "first")
    if os.path.exists(path):
        return path
    raise FileNotFoundError(f"D_{kind} not found at {path!r}; run `openrlhf-div presample` (or presample_ray) first")


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    """One JSON object a line (blank lines and ``#`` lines skipped); errors name file:line."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg}); each line must be one JSON object") \
                    from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}")
            out.append(obj)
    return out


class EmptyAnchorError(ValueError):
    """An anchor method was given an empty D_pef."""


def empty_anchor_message(method: str, anchor_path: str, tau_flag: str = "presample.tau") -> str:
    """Why an empty ``D_pef`` cannot train an anchor method, with the pre-sampling histogram (from
    the ``summary.json`` next to it) and the ``tau`` that would fill it."""
    msg = (f"method {method!r} anchors on D_pef, but {anchor_path} holds no sample: with an empty D_pef it "
           f"trains exactly like GRPO.")
    folder = anchor_path if os.path.isdir(anchor_path) else os.path.dirname(os.path.abspath(anchor_path))
    summary = os.path.join(folder, "summary.json")
    if os.path.exists(summary):
        try:
            with open(summary, encoding="utf-8") as f:
                s = json.load(f)
            hist = s.get("correct_histogram") or []
            n_pre, tau = s.get("n_pre"), s.get("tau")
            best = max((k for k, v in enumerate(hist) if v), default=0)
            msg += (f" Pre-sampling: {s.get('n_prompts')} prompts x {n_pre} samples, near-perfect = #correct >= "
                    f"{tau}; #correct histogram " + " ".join(f"{k}:{v}" for k, v in enumerate(hist)) + ".")
            if best > 0:
                n_at = sum(hist[best:])
                if tau_flag == "presample.tau":
                    how = f"`openrlhf-div presample ... --tau {best} --overwrite` (presample.tau={best}"
                else:
                    how = f"`{tau_flag} {best}` with a fresh output directory ({tau_flag} {best}"
                msg += f" Lower the threshold, e.g. {how}: {n_at} prompt(s) would qualify),"
            else:
                msg += " No prompt was solved even once: the base model cannot anchor on this data;"
        except (OSError, ValueError):
            pass
    return msg + " or train a method without an anchor (e.g. method.name=grpo)."


def read_pef(path: str, *, method: Optional[str] = None, allow_empty: bool = False,
             tau_flag: str = "presample.tau") -> List[AnchorRecord]:
    """All ``D_pef`` records at ``path`` (an output directory or a ``d_pef.jsonl`` file). An empty
    file is an :class:`EmptyAnchorError` (with :func:`empty_anchor_message`) unless ``allow_empty``."""
    f = pef_file(path, "pef")
    recs = [AnchorRecord.from_json(d, where=f"{f}:{i}") for i, d in enumerate(read_jsonl(f), 1)]
    if not recs and not allow_empty:
        raise EmptyAnchorError(empty_anchor_message(method or "?", f, tau_flag))
    return recs


def read_exp(path: str) -> List[Dict[str, Any]]:
    return read_jsonl(pef_file(path, "exp"))


def check_anchor_temperature(anchor_path: str, temperature: float, flag: str = "rollout.temperature") -> None:
    """``D_pef``'s base log-probs are temperature-scaled: refuse a rollout temperature other than
    the one pre-sampling used (read from the ``summary.json`` next to the file, when there is one)."""
    folder = anchor_path if os.path.isdir(anchor_path) else os.path.dirname(os.path.abspath(anchor_path))
    summary = os.path.join(folder, "summary.json")
    if not os.path.exists(summary):
        return
    with open(summary, encoding="utf-8") as f:
        t = json.load(f).get("temperature")
    if t is not None and abs(float(t) - float(temperature)) > 1e-9:
        raise ValueError(f"D_pef base log-probs were computed at temperature {t} but {flag} is {temperature}; "
                         "re-run presample at the rollout temperature")


# ------------------------------------------------------------------ the sampler
class Cursor:
    """Endless seeded stream over ``items``: each epoch is a fresh permutation drawn from
    ``numpy.random.default_rng((seed, epoch))`` (no item repeats before every item was drawn
    once in the epoch). The state is just ``(epoch, pos)``, so a resumed run continues with
    exactly the same items. Both engines draw ``D_pef`` anchors with it; the local engine also
    its prompts."""

    def __init__(self, items: Sequence[Any], seed: int = 0, shuffle: bool = True):
        if len(items) == 0:
            raise ValueError("Cursor needs at least one item (an empty D_pef cannot be sampled)")
        self.items = list(items)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation(0)

    @property
    def records(self) -> List[Any]:
        return self.items

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

    draw = next

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "n": len(self.items)}

    def load_state_dict(self, st: Dict[str, int]) -> None:
        if int(st.get("n", len(self.items))) != len(self.items):
            raise ValueError(f"checkpoint cursor covers {st.get('n')} items but the dataset now has "
                             f"{len(self.items)}; resume with the same data files")
        self.seed = int(st["seed"])
        self.epoch, self.pos = int(st["epoch"]), int(st["pos"])
        self._perm = self._permutation(self.epoch)


AnchorSampler = Cursor


def anchor_count(num_online: int, anchor_batch_size: Optional[int], ratio: float,
                 flags: Tuple[str, str] = ("--div.anchor_batch_size", "--div.anchor_ratio")) -> int:
    """``B_pef`` for a step: the explicit size, else ``ceil(num_online / ratio)`` (at least 1)."""
    if anchor_batch_size is not None:
        if anchor_batch_size < 0:
            raise ValueError(f"{flags[0]} must be >= 0, got {anchor_batch_size}")
        return int(anchor_batch_size)
    if not ratio > 0:
        raise ValueError(f"{flags[1]} must be > 0, got {ratio}")
    return max(1, math.ceil(num_online / ratio))
