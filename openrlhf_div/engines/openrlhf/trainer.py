"""The controller: OpenRLHF's ``PPOTrainer`` with :class:`DivExperienceMaker` as its experience maker.

Everything else (vLLM generation with rewards from the task's reward-function file, weight
broadcast, checkpoints, TensorBoard) is OpenRLHF's. Rollout statistics are computed over the
online rows only (anchor rows carry no reward). It also keeps the run folder a local run keeps
(:mod:`.runfolder`): ``metrics.jsonl`` per step, and the project's evaluation on
``--eval.dataset`` with the trainer's own vLLM engines before the first step and after the last.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List

from openrlhf_div.compat.flash_attn_standin import install as _install_flash_attn_standin

_install_flash_attn_standin()

import ray  # noqa: E402
from openrlhf.trainer.ppo_trainer import PPOTrainer  # noqa: E402

from .experience_maker import DivExperienceMaker  # noqa: E402
from ..contract import ANCHOR_FLAG, row_values  # noqa: E402
from ..flags import check_supported, method_from_args  # noqa: E402

ANCHOR_POOL_STATE = "div_anchor_pool"  # key of the anchor sampler's position in the client states


def online_view(experiences: List) -> List[SimpleNamespace]:
    """The rollout statistics' inputs (reward, response length, truncation) without anchor rows."""
    out = []
    for e in experiences:
        n = int(e.sequences.shape[0])
        keep = row_values(e.info, ANCHOR_FLAG, n) < 0.5
        info = {"reward": row_values(e.info, "reward", n)[keep]} if "reward" in (e.info or {}) else {}
        out.append(SimpleNamespace(
            info=info,
            response_length=None if e.response_length is None else e.response_length.reshape(-1)[keep],
            truncated=None if e.truncated is None else e.truncated.reshape(-1)[keep]))
    return out


#: per-row ``info`` keys that describe a row, not a rollout's outcome: never averaged as an outcome
_ROW_FLAGS = (ANCHOR_FLAG,)


def online_step_metrics(experiences: List) -> Dict[str, float]:
    """The step's per-row figures over the **online rollout rows only**, under OpenRLHF's names
    (``reward``, ``correct``, ``div_correct``, ``return``, ``no_answer``, ...: every per-row number
    in ``Experience.info``), plus the ``D_pef`` anchor rows' own keys: ``anchor/num_samples`` and
    ``anchor/response_length``.

    OpenRLHF's policy actor logs every per-row ``info`` value as a mean over *all* rows of the
    micro-batches it trained on, so anchor rows (no reward: 0; correct by construction:
    ``div_correct`` 1) pulled ``reward`` / ``correct`` down and ``div_correct`` up. The controller
    merges these figures over the actor's (:meth:`_DivPPOTrainer._compute_rollout_stats`), so
    ``metrics.jsonl`` and TensorBoard's ``train/<key>`` mean the online rollouts on every method."""
    sums: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    n_on = n_an = 0
    an_len = 0.0
    for e in experiences:
        n = int(e.sequences.shape[0])
        anchor = row_values(e.info, ANCHOR_FLAG, n) > 0.5
        on = ~anchor
        n_on += int(on.sum())
        n_an += int(anchor.sum())
        if e.response_length is not None and bool(anchor.any()):
            an_len += float(e.response_length.reshape(-1).float()[anchor].sum())
        for k, v in (e.info or {}).items():
            if k in _ROW_FLAGS:
                continue
            try:
                t = row_values(e.info, k, n)
            except (ValueError, TypeError, RuntimeError):
                continue  # not one number per row (a scalar, a string): not a per-row figure
            if bool(on.any()):
                sums[k] = sums.get(k, 0.0) + float(t[on].sum())
                counts[k] = counts.get(k, 0) + int(on.sum())
    out = {k: sums[k] / counts[k] for k in sums if counts.get(k)}
    if n_an:
        out["anchor/num_samples"] = float(n_an)
        out["anchor/response_length"] = an_len / n_an
    return out


def _check_prompts(trainer, args) -> None:
    """No silent truncation: count the training and evaluation prompts over the prompt budget
    (:mod:`openrlhf_div.engines.prompt_budget`); with ``div.drop_long_prompts`` drop them (the
    authors' way) and rebuild the loaders and the step count as OpenRLHF's ``prepare_datasets``
    builds them, the count in the log and the run folder's ``run_info.json``."""
    from ..prompt_budget import check_prompt_budget, keep_rows, record_dropped, tokenizer_counter

    count = tokenizer_counter(trainer.tokenizer)
    div = getattr(args, "div", None)
    truncate = bool(getattr(div, "truncate_prompts", False))
    drop = bool(getattr(div, "drop_long_prompts", False))
    for what, attr, shuffle in (("data.prompt_dataset", "prompts_dataloader", True),
                                ("eval.dataset", "eval_dataloader", False)):
        loader = getattr(trainer, attr, None)
        if loader is None or not hasattr(loader.dataset, "prompts"):
            continue
        summary = check_prompt_budget(loader.dataset.prompts, count, max_len=args.data.max_len,
                                      max_new_tokens=args.rollout.max_new_tokens, truncate=truncate, drop=drop,
                                      what=what)
        if not (drop and summary["over"]):
            continue
        dataset = loader.dataset
        keep_rows(dataset, summary["keep"])
        setattr(trainer, attr, trainer.strategy.setup_dataloader(
            dataset, 1, True, shuffle, dataset.collate_fn, num_workers=args.data.dataloader_num_workers))
        if attr == "prompts_dataloader":  # openrlhf/trainer/ppo_trainer.py prepare_datasets' max_steps
            trainer.max_steps = (len(dataset) * args.rollout.n_samples_per_prompt // args.train.batch_size
                                 * args.train.num_episodes * args.train.max_epochs)
        from .runfolder import run_dir_of

        record_dropped(run_dir_of(args), what, summary)


class _DivPPOTrainer(PPOTrainer.__ray_actor_class__):
    def __init__(self, pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                 reference_model_group, vllm_engines, **generate_kwargs):
        # The controller is in no torch.distributed group, so OpenRLHF's prompt loader shuffles with
        # torch's global RNG, unseeded in this process: two runs with one --train.seed trained on
        # different prompts per step (found by tests/e2e/test_ray_faults.py). Seed it first.
        import random

        import torch

        seed = int(getattr(strategy.args.train, "seed", 0) or 0)
        random.seed(seed)
        torch.manual_seed(seed)
        super().__init__(pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                         reference_model_group, vllm_engines, **generate_kwargs)
        method = method_from_args(strategy.args)
        check_supported(method, strategy.args)
        _check_prompts(self, strategy.args)
        upstream = self.experience_maker
        self.experience_maker = DivExperienceMaker(
            upstream.actor_model_group, upstream.critic_model_group, upstream.reward_model_group,
            upstream.initial_model_group, upstream.kl_ctl, upstream.strategy, upstream.tokenizer,
            method=method)

    # D_pef anchor draws resume where they stopped: the pool's position travels in the checkpoint's
    # client states (OpenRLHF saves them with the actor's checkpoint and hands them back on resume).
    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        pool = getattr(self.experience_maker, "anchor_pool", None)
        if pool is not None and client_states is not None:
            client_states[ANCHOR_POOL_STATE] = pool.state_dict()
        self._div_last_step = int(global_step)
        self._div_folder().log_step(global_step, logs_dict or {})
        self._div_progress_step(global_step, logs_dict or {})
        try:
            return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        finally:
            # the step's metrics reach the disk now, not at SummaryWriter's next 120 s flush: a
            # checkpoint save that fails (full disk, a killed actor) must not take them along
            writer = getattr(getattr(self, "tensorboard_logger", None), "writer", None)
            if writer is not None:
                writer.flush()

    def _div_folder(self):
        from .runfolder import RunFolder

        if getattr(self, "_div_run_folder", None) is None:
            self._div_run_folder = RunFolder(self.args)
        return self._div_run_folder

    def fit(self, global_step: int = 0) -> None:
        """OpenRLHF's loop, with the run folder's evaluations around it: the initial policy (step 0,
        unless resuming) and the final one (the weights the last step broadcast to vLLM)."""
        states = super().init_checkpoint_states()
        start = int(states.get("global_step", 0) or 0)
        self._div_folder().truncate(start)  # rows of steps a resumed run redoes
        self._div_last_step = start
        if start == 0:
            self._div_evaluate(0)
        self._div_bar = _progress(self, start)
        import openrlhf.trainer.ppo_trainer as upstream

        bar, upstream.tqdm = upstream.tqdm, _QuietBar  # our step line replaces OpenRLHF's prompt bar
        try:
            out = super().fit(global_step)
        except Exception as exc:  # noqa: BLE001
            _raise_naming_dead_engine(self, exc)
            raise
        finally:
            upstream.tqdm = bar
            self._div_bar.close()
        if self._div_last_step > start:
            self._div_evaluate(self._div_last_step)
        return out

    def _div_progress_step(self, step: int, logs) -> None:
        """One progress line per step (:func:`openrlhf_div.progress.ray_step_figures`, the local
        engine's formatter): ``train grpo: 3/10 (30%) 41.0 s, 0.0732 step/s, ETA 1 min 36 s,
        reward=..., loss=..., entropy=..., [anchor=...,] s_per_step=...``."""
        from openrlhf_div.progress import ray_step_figures

        bar = getattr(self, "_div_bar", None)
        if bar is None:
            return
        method = method_from_args(self.args)
        bar.set_postfix(ray_step_figures(logs, int(step), anchor=bool(method.needs.anchor_batch)))
        bar.update(int(step) - bar.n)

    def _div_evaluate(self, step: int) -> None:
        """The run folder's evaluation; a failure there is reported (one line + its traceback on
        stderr) and does not take the training down: the run folder then lacks that evaluation."""
        import sys
        import traceback

        from .runfolder import evaluate_with_engines

        try:
            row = evaluate_with_engines(self, step)
            if row:
                from openrlhf_div.progress import passk_line

                print(f"[openrlhf-div] {passk_line(row)}", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            print(f"[openrlhf-div] error: the run folder's evaluation at step {step} failed "
                  f"({type(exc).__name__}: {exc}); training goes on, eval.json of that step is missing",
                  file=sys.stderr, flush=True)

    def init_checkpoint_states(self) -> Dict:
        states = super().init_checkpoint_states()
        pool = getattr(self.experience_maker, "anchor_pool", None)
        if pool is not None and states.get(ANCHOR_POOL_STATE):
            pool.load_state_dict(states[ANCHOR_POOL_STATE])
        return states

    def _compute_rollout_stats(self, experiences) -> Dict:
        # OpenRLHF's train_step merges these over the actor's status (status.update(rollout_stats)):
        # the per-row figures below replace the actor's means over online + anchor rows
        stats = online_step_metrics(experiences)
        stats.update(super()._compute_rollout_stats(online_view(experiences)))
        stats["rollout/num_anchor_samples"] = float(getattr(self.experience_maker, "last_num_anchors", 0))
        return stats


class _QuietBar:
    """OpenRLHF's per-episode prompt bar, silenced (the controller prints its own step line)."""

    def __init__(self, *a, **kw):
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(trainer, start: int):
    """The controller's step line (:class:`openrlhf_div.progress.LineProgress`, one line per step):
    ``train <method>: k/N``, N = episodes x prompts per episode / prompts per step (with dynamic
    filtering a step may consume more prompts: N is then an upper bound)."""
    import sys

    from openrlhf_div.progress import LineProgress

    args = trainer.args
    try:
        per_episode = len(trainer.prompts_dataloader) // max(1, int(args.rollout.batch_size))
        total = max(1, per_episode) * int(args.train.num_episodes)
    except (TypeError, AttributeError):
        total = None
    name = method_from_args(args).name
    return LineProgress(total, desc=f"[openrlhf-div] train {name}", unit="step", initial=start, stream=sys.stderr,
                        every_percent=0.0, every_seconds=0.0)


def _raise_naming_dead_engine(trainer, exc: BaseException) -> None:
    """A step failed: when a vLLM engine process of the trainer's rollout actors died, raise an error
    carrying its one line (``compat/engine_death.py``; the job's driver prints it last), chained to
    ``exc``. The controller often sees only the symptom (the weight sync's gloo "Connection closed
    by peer"); the vLLM actor that owned the process knows its signal."""
    from openrlhf_div.compat.engine_death import MARK, remote_dead_engine_lines

    lines = remote_dead_engine_lines(getattr(trainer, "vllm_engines", None))
    if lines:
        raise RuntimeError(f"the rollout engine died: {MARK}{lines[0]}]") from exc


DivPPOTrainer = ray.remote(_DivPPOTrainer)
