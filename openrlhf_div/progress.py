"""The one progress helper: a redrawn bar on a terminal, plain lines in a file.

Every progress display of the project (training steps, evaluation, pre-sampling, the demo's
warm-up, the bandit) goes through :func:`progress_bar`. On a terminal it is a ``tqdm`` bar
(carriage-return redraws). When the stream is not a terminal (a log file, a pipe, CI) it is a
:class:`LineProgress`: one ordinary line at most every ``every_percent`` percent of the total
or every ``every_seconds`` seconds (whichever comes first), plus one at the end, so a log
written to a file holds no ``\\r`` redraws::

    train grpo: 40/100 (40%) 12.3 s, 3.25 step/s, ETA 18 s, reward=0.512, loss=0.0131, entropy=0.83

Libraries we drive get the same treatment: :func:`quiet_library_bars` turns the Hugging Face
Hub / transformers bars off around model loading and saving (per-shard noise inside a run);
vLLM is called with ``use_tqdm=False``.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Dict, Optional, TextIO

__all__ = ["progress_bar", "LineProgress", "is_terminal", "quiet_library_bars", "step_figures", "ray_step_figures",
           "passk_line"]


def is_terminal(stream: Optional[TextIO] = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


class _NoProgress:
    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, *a: Any, **kw: Any) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_description(self, *a: Any, **kw: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


class LineProgress(_NoProgress):
    """Progress as plain lines (see the module docstring); the ``tqdm`` methods the project uses
    (``update``, ``set_postfix``, ``set_description``, ``close``, context manager)."""

    def __init__(self, total: Optional[int], desc: str = "", unit: str = "it", initial: int = 0,
                 stream: Optional[TextIO] = None, every_percent: float = 10.0, every_seconds: float = 30.0,
                 clock=time.monotonic):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self._start = int(initial)
        self.stream = stream
        self.every_percent, self.every_seconds = float(every_percent), float(every_seconds)
        self._clock = clock
        self._t0 = self._last_t = clock()
        self._last_pct = self._pct()
        self._postfix = ""
        self._closed = False
        self._printed_n = None

    def _pct(self) -> float:
        return 100.0 * self.n / self.total if self.total else 0.0

    def _line(self) -> str:
        el = self._clock() - self._t0
        done = self.n - self._start
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            head += f"{self.n}/{self.total} ({self._pct():.0f}%)"
        else:
            head += f"{self.n} {self.unit}"
        rate = f", {done / el:.3g} {self.unit}/s" if el > 0 and done > 0 else ""
        eta = ""
        if self.total and el > 0 and done > 0 and self.n < self.total:
            eta = f", ETA {_duration((self.total - self.n) * el / done)}"
        return f"{head} {el:.1f} s{rate}{eta}" + (f", {self._postfix}" if self._postfix else "")

    def _emit(self) -> None:
        print(self._line(), file=self.stream if self.stream is not None else sys.stderr, flush=True)
        self._last_t, self._last_pct, self._printed_n = self._clock(), self._pct(), self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._clock()
        if (self.total and self._pct() - self._last_pct >= self.every_percent) or \
                now - self._last_t >= self.every_seconds:
            self._emit()

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kw: Any) -> None:
        items = dict(ordered_dict or {}, **kw)
        self._postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self._postfix = str(s)

    def set_description(self, desc: Optional[str] = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._printed_n != self.n and self.n != self._start:
                self._emit()


def progress_bar(total: Optional[int] = None, desc: str = "", unit: str = "it", initial: int = 0,
                 disable: bool = False, stream: Optional[TextIO] = None, every_percent: float = 10.0,
                 every_seconds: float = 30.0, **tqdm_kwargs: Any):
    """A ``tqdm`` bar on a terminal, a :class:`LineProgress` otherwise, nothing when
    ``disable``. ``stream`` defaults to ``sys.stderr``; ``tqdm_kwargs`` go to ``tqdm`` only."""
    if disable:
        return _NoProgress()
    if is_terminal(stream):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, initial=initial, file=stream, **tqdm_kwargs)
    return LineProgress(total, desc=desc, unit=unit, initial=initial, stream=stream, every_percent=every_percent,
                        every_seconds=every_seconds)


def step_figures(m: Dict[str, Any], step: int) -> Dict[str, str]:
    """The training progress line's figures of a step's metrics (every engine: the local
    trainer's metric names; :func:`ray_step_figures` maps the Ray path's onto them): reward, loss,
    the policy's entropy, the anchor term for methods that have one (DPH: ``loss_pef``),
    degenerate steps, seconds per step (the line itself adds the ETA). A figure the metrics lack
    is left out."""
    out = {"reward": f"{m['reward_mean']:.3f}", "loss": f"{m.get('loss', float('nan')):.4f}"}
    if "entropy" in m:
        out["entropy"] = f"{m['entropy']:.3f}"
    if "loss_pef" in m:
        out["anchor"] = f"{m['loss_pef']:.4f}"
    if "degenerate_steps_total" in m:
        out["degenerate"] = f"{int(m['degenerate_steps_total'])}/{step}"
    if "time_step" in m:
        out["s_per_step"] = f"{m['time_step']:.2f}"
    return out


#: the Ray path's metric names (OpenRLHF's logs + the div actor's ``div/*``) of :func:`step_figures`'
RAY_METRIC_NAMES = {"reward_mean": "rollout/reward_mean", "loss": "div/loss", "entropy": "div/entropy",
                    "loss_pef": "div/loss_pef", "time_step": "timing/step_total"}


def ray_step_figures(logs: Dict[str, Any], step: int, anchor: bool) -> Dict[str, str]:
    """:func:`step_figures` of a Ray step's logs (``metrics.jsonl``'s row); ``anchor``: the method
    has a D_pef anchor term (every method logs ``div/loss_pef``, 0 without anchors)."""
    m: Dict[str, Any] = {}
    for ours, theirs in RAY_METRIC_NAMES.items():
        v = logs.get(theirs)
        if v is None and ours == "loss":
            v = logs.get("policy_loss")
        if v is not None and (anchor or ours != "loss_pef"):
            m[ours] = float(v)
    m.setdefault("reward_mean", float("nan"))
    return step_figures(m, step)


def passk_line(row: Dict[str, Any]) -> str:
    """``[eval] step 20: pass@1 0.281, pass@4 0.500 (8 prompts x 4 samples)`` from an ``eval.jsonl`` row."""
    ks = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.startswith("pass@"))
    return f"[eval] step {row['step']}: {ks} ({row['n_prompts']} prompts x {row['n_samples']} samples)"


@contextmanager
def quiet_library_bars():
    """Turn off the progress bars of Hugging Face Hub / transformers (weights loading, saving)
    while inside."""
    old = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    hub = tf = None
    try:
        try:
            from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars

            hub = are_progress_bars_disabled()
            disable_progress_bars()
        except ImportError:  # pragma: no cover
            pass
        try:
            from transformers.utils import logging as tf_logging

            tf = tf_logging.is_progress_bar_enabled()
            tf_logging.disable_progress_bar()
        except ImportError:  # pragma: no cover
            pass
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        else:
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = old
        if hub is False:
            from huggingface_hub.utils import enable_progress_bars

            enable_progress_bars()
        if tf:
            from transformers.utils import logging as tf_logging

            tf_logging.enable_progress_bar()
