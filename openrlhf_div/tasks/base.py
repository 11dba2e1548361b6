"""The task interface and registry."""
from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union


@dataclass
class RewardResult:
    """A scored response: ``reward`` in [0, 1] (task-defined), ``correct`` for pass@k,
    and a short ``reason`` for logs (``"ok"``, ``"no answer found"``, ``"timeout"``, ...).
    ``info`` carries task extras (e.g. the demo's solution style)."""

    reward: float
    correct: bool
    reason: str = "ok"
    info: Dict[str, Any] = field(default_factory=dict)


class Task:
    """Base class. Subclasses set ``name`` and implement ``prompt`` and ``score``."""

    name: str = "task"

    def prompt(self, example: Dict[str, Any]) -> Union[str, List[Dict[str, str]]]:
        """The prompt text (or chat messages) for one normalised example
        ``{"prompt", "label", "source", "id"}``."""
        raise NotImplementedError

    def score(self, response: str, label: Any) -> RewardResult:
        """Score one response; may raise. :meth:`reward_result` wraps it so callers never see
        an exception."""
        raise NotImplementedError

    def reward_result(self, response: str, label: Any) -> RewardResult:
        try:
            return self.score(response, label)
        except Exception as exc:  # noqa: BLE001 - a verifier must never take the trainer down
            return RewardResult(0.0, False, f"verifier error: {type(exc).__name__}: {exc}")

    def reward(self, response: str, label: Any) -> float:
        """The scalar reward; never raises (failures are 0)."""
        return float(self.reward_result(response, label).reward)


# name -> factory(**options) -> Task; modules imported lazily on first use
_FACTORIES: Dict[str, Callable[..., Task]] = {}
_LAZY: Dict[str, str] = {}


def register_task(name: str, factory: Optional[Callable[..., Task]] = None, module: Optional[str] = None):
    """Register a task factory (or a module that registers it on import)."""
    if module is not None:
        _LAZY[name] = module
        return None
    if factory is None:
        def deco(f):
            _FACTORIES[name] = f
            return f
        return deco
    _FACTORIES[name] = factory
    return factory


def list_tasks() -> List[str]:
    return sorted(set(_FACTORIES) | set(_LAZY))


def get_task(name: str, **options) -> Task:
    if name not in _FACTORIES and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _FACTORIES:
        valid = list_tasks()
        close = difflib.get_close_matches(name, valid, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown task {name!r}.{hint} Valid tasks: {', '.join(valid)}")
    return _FACTORIES[name](**options)
