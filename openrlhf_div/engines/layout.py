"""Engine layout: how an engine cuts one rollout step into optimiser steps and micro-batches.

These settings are the engine's, not the method's (the method is the formula,
docs/ALGORITHMS.md): they live in an experiment's ``layout:`` section (``--layout.*`` on the
OpenRLHF / Megatron command line, also spelled ``--engine.*``, the spelling printed commands keep;
the section's old name ``engine:`` still loads with one stderr line: "engine" is the trainer,
``run --engine``) and reach the planner through :class:`EngineLayout`, the one
call site both Ray-topology engines (the OpenRLHF policy actor and the Megatron actor) share.

Under aggregation ``micro-batch-token-mean`` (the DPH-RL authors' update loop,
docs/ALGORITHMS.md section 9 rows 1, 1b, 2) an engine lays its rows out with
:func:`openrlhf_div.algorithms.authors.plan_micro_batches`; the group size of that aggregation,
``micro_batch_seqs``, stays a method hyperparameter (it is part of the loss's formula on every
engine, the local one included). Every other aggregation uses the engine's own micro-batches.

The local engine lays micro-batches out with ``optim.micro_batch_size`` / ``optim.mini_batches``
and refuses a non-default layout by name (:func:`refuse_on_local`).

No torch-heavy or engine import here: the launcher, ``--help`` and the config tests use it.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from openrlhf_div.algorithms._utils import unknown_name_error
from openrlhf_div.algorithms.authors import (MICRO_BATCH_TOKEN_MEAN, MIXED_MICRO_BATCHES, STEP_LAYOUTS,
                                             plan_micro_batches)

#: key -> (default, one line of help, source). The defaults are the library's (the spec's clean
#: form); the authors' values are what configs/openrlhf/_llama8b_bird.yaml sets.
LAYOUT_KEYS: Dict[str, tuple] = {
    "step_layout": (
        "spread",
        "optimiser steps of one rollout step under micro-batch-token-mean: spread (every step holds its share "
        "of the anchors) or authors (the anchors in trailing steps of their own)",
        "docs/ALGORITHMS.md section 9 row 1a; seamoke/DPH-RL ray_trainer.py fit + dp_actor.py update_policy "
        "batch.split(ppo_mini_batch_size)"),
    "micro_batch_tokens": (
        None,
        "token budget per micro-batch under micro-batch-token-mean (token-balanced partitions); null: "
        "micro-batches of the method's micro_batch_seqs rows",
        "docs/ALGORITHMS.md section 9 row 1b; seamoke/DPH-RL verl/trainer/config/ppo_trainer.yaml "
        "use_dynamic_bsz, ppo_max_token_len_per_gpu: 32384"),
    "authors_world_size": (
        None,
        "with step_layout authors: lay each rollout step out as the authors' code did at this many GPUs "
        "(balance_batch reorder, contiguous rank chunks, per-rank mini-batches, 1/W gradient mean), whatever "
        "world size the engine runs on; null: each engine rank's own rows (the authors' one-GPU form)",
        "docs/ALGORITHMS.md section 9 row 10; DPH-RL paper section 5 (32 A800 GPUs); seamoke/DPH-RL "
        "ray_trainer.py _balance_batch + dp_actor.py update_policy (data split per rank)"),
    "mixed_micro_batches": (
        "separate",
        "separate: anchors and rollouts never share a micro-batch; first_row: the authors' mixed micro-batches "
        "(anchors after a rollout in one micro-batch get the PPO loss at the group-of-one advantage +1 against "
        "their stored log-probs); needs authors_world_size",
        "docs/ALGORITHMS.md section 9 row 10b; seamoke/DPH-RL dp_actor.py update_policy (the micro-batch's first "
        "row decides the loss) + ray_trainer.py compute_advantage (GRPO group of one)"),
}
#: old spellings (a method hyperparameter under ``div:`` / ``method:`` / ``--div.*``), read for one
#: release with a one-line deprecation naming the new key
MOVED_FROM_METHOD = tuple(LAYOUT_KEYS)


def deprecation(old: str, new: str) -> str:
    """The one-line deprecation of an old spelling."""
    return f"openrlhf-div: `{old}` is deprecated and will be refused in the next release; write `{new}`"


@dataclass(frozen=True)
class EngineLayout:
    """The ``layout:`` settings of a run (see the module docstring)."""

    step_layout: str = LAYOUT_KEYS["step_layout"][0]
    micro_batch_tokens: Optional[int] = LAYOUT_KEYS["micro_batch_tokens"][0]
    authors_world_size: Optional[int] = LAYOUT_KEYS["authors_world_size"][0]
    mixed_micro_batches: str = LAYOUT_KEYS["mixed_micro_batches"][0]

    def __post_init__(self):
        if self.step_layout not in STEP_LAYOUTS:
            raise unknown_name_error("layout.step_layout", self.step_layout, STEP_LAYOUTS)
        if self.mixed_micro_batches not in MIXED_MICRO_BATCHES:
            raise unknown_name_error("layout.mixed_micro_batches", self.mixed_micro_batches, MIXED_MICRO_BATCHES)
        aws = self.authors_world_size
        if isinstance(aws, str) and aws.strip().lower() in ("none", "null"):
            aws = None
            object.__setattr__(self, "authors_world_size", None)
        if aws is not None:
            if int(aws) < 1 or self.step_layout != "authors":
                raise ValueError(f"layout.authors_world_size must be >= 1 with layout.step_layout: authors (the "
                                 f"authors' GPU count lays out their steps), got {aws} with step_layout "
                                 f"{self.step_layout}")
            object.__setattr__(self, "authors_world_size", int(aws))
        if self.mixed_micro_batches != "separate" and aws is None:
            raise ValueError("layout.mixed_micro_batches: first_row reproduces the authors' micro-batches at their GPU "
                             "count; set layout.authors_world_size too (or layout.mixed_micro_batches: separate)")
        mbt = self.micro_batch_tokens
        if isinstance(mbt, str) and mbt.strip().lower() in ("none", "null"):
            object.__setattr__(self, "micro_batch_tokens", None)
        elif mbt is not None:
            if int(mbt) < 1:
                raise ValueError(f"layout.micro_batch_tokens must be >= 1 or null (micro-batches of the method's "
                                 f"micro_batch_seqs rows), got {mbt}")
            object.__setattr__(self, "micro_batch_tokens", int(mbt))

    # -------------------------------------------------------------- reading
    @classmethod
    def from_mapping(cls, d: Optional[Mapping[str, Any]], where: str = "layout") -> "EngineLayout":
        """From a mapping (a ``layout:`` section); keys other than the layout's are ignored here."""
        d = dict(d or {})
        return cls(**{k: d[k] for k in LAYOUT_KEYS if k in d and d[k] is not None})

    @classmethod
    def from_args(cls, args) -> "EngineLayout":
        """From a parsed OpenRLHF / Megatron namespace: ``args.engine.*`` after OpenRLHF's
        ``hierarchize``, or the flat ``engine.*`` keys before it; absent keys are defaults."""
        eng = getattr(args, "engine", None)
        if eng is not None and not isinstance(eng, str):
            d = vars(eng) if not isinstance(eng, Mapping) else dict(eng)
        else:
            d = {k[7:]: v for k, v in vars(args).items() if k.startswith("engine.")}
        return cls.from_mapping(d)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def is_default(self) -> bool:
        return self == EngineLayout()

    # -------------------------------------------------------------- the one planner call site
    def plan(self, method, is_anchor: Sequence[bool], tokens: Optional[Sequence[int]] = None, *,
             mini_batch_rows: int, sync: Optional[Callable[[int], int]] = None):
        """This replica's optimiser steps for ``method`` under this layout
        (:func:`~openrlhf_div.algorithms.authors.plan_micro_batches`)."""
        return plan_micro_batches(is_anchor, tokens, mini_batch_rows=int(mini_batch_rows),
                                  micro_batch_seqs=int(method.hparams["micro_batch_seqs"]),
                                  micro_batch_tokens=self.micro_batch_tokens, step_layout=self.step_layout,
                                  sync=sync, authors_world_size=self.authors_world_size,
                                  mixed_micro_batches=self.mixed_micro_batches)


def uses_authors_layout(method) -> bool:
    """Whether an engine lays micro-batches out as the DPH-RL authors' update loop does
    (aggregation ``micro-batch-token-mean``)."""
    return method.aggregation == MICRO_BATCH_TOKEN_MEAN


def refuse_on_local(layout: EngineLayout) -> Optional[str]:
    """The one-line refusal of a layout the local engine cannot honour (None: it can)."""
    bad = [f"layout.{k}={v}" for k, v in layout.to_dict().items() if v != LAYOUT_KEYS[k][0]]
    if not bad:
        return None
    return (f"{', '.join(bad)}: the local engine cannot honour this layout (the DPH-RL authors' update loop runs "
            "on the OpenRLHF and Megatron engines); the local engine uses optim.micro_batch_size and "
            "optim.mini_batches: drop it here or run the experiment on the OpenRLHF or Megatron engine")


# ------------------------------------------------------------------ the --layout.* flags
def _int_or_none(s: str):
    return None if str(s).strip().lower() in ("none", "null", "off") else int(s)


class _Deprecated(argparse.Action):
    """``--div.<key>`` of a layout key: stored under ``engine.<key>`` with a one-line deprecation."""

    def __call__(self, parser, namespace, values, option_string=None):
        import sys

        print(deprecation(option_string, option_string.replace("--div.", "--layout.")), file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The ``--layout.*`` flags, also spelled ``--engine.*`` (the rendered spelling: a printed command
    stays what it was), and the old ``--div.<key>`` spellings, hidden. The namespace keeps
    ``engine.<key>`` (``args.engine.*`` after OpenRLHF's ``hierarchize``)."""
    g = parser.add_argument_group("micro-batch layout (--layout.*, also --engine.*)",
                                  "How the OpenRLHF / Megatron engines cut a rollout step into optimiser steps "
                                  "and micro-batches (an experiment's `layout:` section).")
    for key, (default, text, source) in LAYOUT_KEYS.items():
        kw: Dict[str, Any] = {"default": None, "dest": f"engine.{key}", "metavar": "V",
                              "help": f"{text} (default {default if default is not None else 'none'}; "
                                      f"source: {source})"}
        if key == "step_layout":
            kw.update(choices=list(STEP_LAYOUTS), metavar=None)
        elif key == "mixed_micro_batches":
            kw.update(choices=list(MIXED_MICRO_BATCHES), metavar=None)
        else:
            kw.update(type=_int_or_none)
        g.add_argument(f"--layout.{key}", f"--engine.{key}", **kw)
        hidden = dict(kw, help=argparse.SUPPRESS, action=_Deprecated)
        g.add_argument(f"--div.{key}", **hidden)
    return g


def layout_argv(section: Mapping[str, Any]) -> List[str]:
    """The ``--engine.*`` flags of a ``layout:`` section's keys (the spelling printed commands have
    always had; ``--layout.*`` is read too)."""
    out: List[str] = []
    for k in LAYOUT_KEYS:
        if k in section:
            v = section[k]
            out += [f"--engine.{k}", "none" if v is None else str(v)]
    return out
