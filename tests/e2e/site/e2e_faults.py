"""Fault injection for the Ray fault corpus (tests/e2e/test_ray_faults.py), loaded by
``sitecustomize`` in every process of the test cluster; never by production code. Each fault is
off unless its variable is set in the job's environment (``OPENRLHF_DIV_*`` variables travel with
``ray job submit`` to every worker):

* ``OPENRLHF_DIV_E2E_FAULT_NAN_LOSS_STEP=N``: at rollout step N the policy actor's loss is
  multiplied by NaN (what a poisoned batch or an overflow does), before openrlhf-div's guard.
* ``OPENRLHF_DIV_E2E_TRACE=1`` (a recorder, not a fault): the controller appends to
  ``$RUN_DIR/fault_trace.jsonl`` per rollout step the step number, the prompts it trains on
  (in order) and the D_pef anchors drawn for it (id and a hash of its tokens).
* ``OPENRLHF_DIV_E2E_FAULT_HOLD_STEP=N``: the controller stops after step N's rollout (its
  rewards computed), before training on it, writes ``$RUN_DIR/fault_hold_step.pid`` and waits
  for ``$RUN_DIR/fault_hold_step.go`` (the tiny steps take a second: the test injects its fault
  in this pause).
* ``OPENRLHF_DIV_E2E_FAULT_HOLD_SAVE_STEP=N``: DeepSpeed's save of ``global_stepN`` stops after
  the model-states file, before the optimizer states (a save in progress), writes
  ``$RUN_DIR/fault_hold_save.pid`` and waits there, so the test can kill the policy actor from
  outside (SIGKILL, found through Ray's state API) in the middle of the save.
"""
from __future__ import annotations

import os
import time

NAN_STEP = "OPENRLHF_DIV_E2E_FAULT_NAN_LOSS_STEP"
HOLD_SAVE = "OPENRLHF_DIV_E2E_FAULT_HOLD_SAVE_STEP"
HOLD_MARKER = "fault_hold_save.pid"
HOLD_STEP = "OPENRLHF_DIV_E2E_FAULT_HOLD_STEP"
HOLD_STEP_NAME = "fault_hold_step"
TRACE = "OPENRLHF_DIV_E2E_TRACE"  # =1: $RUN_DIR/fault_trace.jsonl, one line per rollout step
TRACE_FILE = "fault_trace.jsonl"


def _step(var: str):
    v = os.environ.get(var, "")
    return int(v) if v.strip() else None


def _patch_actor(mod) -> None:
    cls = mod.DivActorPPOTrainer
    if getattr(cls, "_e2e_faults", False):
        return
    upstream = cls.training_step

    def training_step(self, *args, **kwargs):
        if _step(NAN_STEP) is None or _step(NAN_STEP) != getattr(self, "div_step", None):
            return upstream(self, *args, **kwargs)
        real = mod.div_actor_loss

        def nan_loss(*a, **kw):
            loss, metrics = real(*a, **kw)
            return loss * float("nan"), metrics

        mod.div_actor_loss = nan_loss
        try:
            return upstream(self, *args, **kwargs)
        finally:
            mod.div_actor_loss = real

    cls.training_step = training_step
    cls._e2e_faults = True


def _patch_engine(mod) -> None:
    cls = mod.DeepSpeedEngine
    if getattr(cls, "_e2e_faults", False):
        return
    upstream = cls._save_zero_checkpoint

    def _save_zero_checkpoint(self, save_path, tag):
        step = _step(HOLD_SAVE)
        if step is not None and str(tag) == f"global_step{step}":
            marker = os.path.join(os.environ.get("RUN_DIR", "."), HOLD_MARKER)
            with open(marker, "w") as fh:
                fh.write(str(os.getpid()))
            time.sleep(3600)  # killed from outside
        return upstream(self, save_path, tag)

    cls._save_zero_checkpoint = _save_zero_checkpoint
    cls._e2e_faults = True


def _hold(name: str) -> None:
    """Write ``$RUN_DIR/<name>.pid`` and wait until the test writes ``$RUN_DIR/<name>.go``."""
    root = os.environ.get("RUN_DIR", ".")
    with open(os.path.join(root, name + ".pid"), "w") as fh:
        fh.write(str(os.getpid()))
    deadline = time.time() + 600  # a test that failed before releasing it never blocks the cluster for long
    while not os.path.exists(os.path.join(root, name + ".go")) and time.time() < deadline:
        time.sleep(0.1)


def _patch_trainer(mod) -> None:
    import json

    cls = mod.BasePPOTrainer  # the base of openrlhf-div's controller (as e2e_probe patches it)
    if getattr(cls, "_e2e_trace", False):
        return
    upstream = cls.train_step

    def train_step(self, rollout_samples, global_step):
        if _step(HOLD_STEP) == global_step + 1:
            _hold(HOLD_STEP_NAME)
        if os.environ.get(TRACE) != "1":
            return upstream(self, rollout_samples, global_step)
        prompts = [p for s in rollout_samples for p in (s.prompts or [])]
        drawn = []
        pool = getattr(self.experience_maker, "anchor_pool", None)
        real = pool.draw if pool is not None else None
        if pool is not None:
            def draw(n):
                recs = real(n)
                import hashlib  # the tiny D_pef has no ids: the record's tokens identify it

                drawn.extend(f"{r.id}|" + hashlib.sha1(json.dumps([list(r.prompt_ids), list(r.response_ids)])
                                                       .encode()).hexdigest()[:12] for r in recs)
                return recs

            pool.draw = draw
        try:
            return upstream(self, rollout_samples, global_step)
        finally:
            if pool is not None:
                pool.draw = real
            with open(os.path.join(os.environ.get("RUN_DIR", "."), TRACE_FILE), "a") as fh:
                fh.write(json.dumps({"step": global_step + 1, "prompts": prompts, "anchors": drawn}) + "\n")

    cls.train_step = train_step
    cls._e2e_trace = True


def install() -> None:
    from openrlhf_div.compat import cpu_seams

    cpu_seams.add_hook("openrlhf_div.engines.openrlhf.actor", _patch_actor)
    cpu_seams.add_hook("deepspeed.runtime.engine", _patch_engine)
    cpu_seams.add_hook("openrlhf.trainer.ppo_trainer", _patch_trainer)


install()  # imported by the CPU layer's sitecustomize (OPENRLHF_DIV_SITE_HOOKS); each injection is off unless its variable is set
