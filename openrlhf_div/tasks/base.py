"""The task interface and registry."""
from __future__ import annotations

import difflib
import json
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Union

#: Answer extraction reads at most this many characters of a response: the last ones (a final
#: answer, the last code block or ``<answer>`` tag), or the first ones where a task is told to take
#: the first block. Every extractor is linear-time besides; the window bounds the work per
#: response (a policy that emits 10 MB of junk costs the trainer no more than 32 KB does).
MAX_EXTRACT_CHARS = 32_768


def extraction_window(text: str, first: bool = False, limit: int = MAX_EXTRACT_CHARS) -> str:
    """The part of ``text`` that answer extraction reads (see :data:`MAX_EXTRACT_CHARS`)."""
    if len(text) <= limit:
        return text
    return text[:limit] if first else text[-limit:]


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
    #: ``openrlhf-div eval``'s default ``--max-new-tokens`` for this task: long enough for its answers
    eval_max_new_tokens: int = 1024

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

    # ---- extensions (defaults work for every task; verifiers override for speed) ----
    def score_batch(self, responses: Sequence[str], labels: Sequence[Any]) -> List[RewardResult]:
        """Score many responses (verifiers with worker pools override this to run them in
        parallel). Subclass versions may raise; :meth:`reward_results` never does."""
        return [self.score(r, lab) for r, lab in zip(responses, labels)]

    def reward_results(self, responses: Sequence[str], labels: Sequence[Any]) -> List[RewardResult]:
        """Batch form of :meth:`reward_result`: one result per response, never raises."""
        if len(responses) != len(labels):
            raise ValueError(f"reward_results: {len(responses)} responses but {len(labels)} labels")
        try:
            out = list(self.score_batch(responses, labels))
            if len(out) == len(responses):
                return out
        except Exception:  # noqa: BLE001 - fall back to one at a time, each guarded
            pass
        return [self.reward_result(r, lab) for r, lab in zip(responses, labels)]

    def render_prompt(self, example: Dict[str, Any], tokenizer=None) -> str:
        """The prompt as text: chat messages go through the tokenizer's chat template when it
        has one (with the generation prompt appended), else a plain-text fallback."""
        return render_prompt(self.prompt(example), tokenizer)

    def solution_key(self, response: str, result: RewardResult) -> Hashable:
        """What identifies a *solution* for distinct-correct counts (ALGORITHMS.md section 6):
        ``result.info["style"]`` when the task reports one (the demo), else the response with
        whitespace collapsed. Tasks override it (SQL: the normalised query; Countdown: the
        equation)."""
        style = result.info.get("style") if result.info else None
        if style is not None:
            return style
        return " ".join(response.split())

    def grading(self) -> str:
        """One line saying how responses are graded (``eval`` prints it with its results)."""
        return "task-defined"

    def close(self) -> None:
        """Release worker processes, if the task holds any (pools are shared and also closed
        at exit, so calling this is optional)."""


def render_prompt(prompt: Union[str, List[Dict[str, str]]], tokenizer=None) -> str:
    """Text for a model: a string is returned as is; chat messages use
    ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` when the tokenizer has a
    chat template, else their contents joined by blank lines and a trailing newline."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in prompt) + "\n"


def decode_label(label: Any, task: str, expected: str) -> Dict[str, Any]:
    """A structured label as a dict: labels may arrive JSON-encoded (OpenRLHF passes strings).
    Raises ``ValueError`` naming the task and the expected keys."""
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{task} label is not valid JSON ({exc}); expected {expected}") from None
    if not isinstance(label, dict):
        raise ValueError(f"{task} label must be a dict {expected}, got {type(label).__name__}")
    return label


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
    """The task ``name`` built with ``options``; a name not registered yet is looked up again
    after importing the plug-ins of ``OPENRLHF_DIV_PLUGINS`` (:mod:`openrlhf_div.plugins`), so a
    plug-in task resolves in every process that names it (Ray workers included)."""
    if name not in _FACTORIES and name not in _LAZY:
        from openrlhf_div.plugins import load_plugins

        load_plugins()
    if name not in _FACTORIES and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _FACTORIES:
        valid = list_tasks()
        close = difflib.get_close_matches(name, valid, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown task {name!r}.{hint} Valid tasks: {', '.join(valid)}")
    return _FACTORIES[name](**options)
