"""The local engine's RL trainer: one process, one Hugging Face causal LM.

One RL step, top to bottom (:meth:`Trainer.train_step`)::

    experience = make_experience()      # rollouts -> rewards -> shaping -> keep -> old/ref lp -> advantages
      B prompts x G samples (generation.generate, KV cache, temperature T)
      old_t  = sequence_log_probs(policy)     no_grad, the behaviour policy at rollout time
      R_i    = task.reward_results(texts, labels)[i].reward  (batched; never raises)
      R', keep, correct, A_t = method.rollout(R, G, old_log_probs, mask, lengths)   per round
                                              (shaping; kept groups: mixed correctness; advantages)
      refill with new prompts until B groups are kept (dynamic sampling)
      ref_t  = sequence_log_probs(reference)  only if method.needs.ref_log_probs
    optimise(experience)
      for epoch in ppo_epochs, for mini-batch (one AdamW step each):
        anchors = ceil(rows / anchor_ratio) D_pef samples   only if needs.anchor_batch
        for micro-batch (gradient accumulation):
          one forward over online rows + anchor rows: lp_t (+ H_t if needs.entropy,
              + mean-pooled prompt states -> log Z head if needs.prompt_hidden)
          loss = method.loss(online=LossInputs(...), anchor=AnchorInputs(...),
                             num_online_tokens=<mini-batch total>, num_anchor_tokens=<total>)
          loss.backward()
        clip_grad_norm_, AdamW step

The engine never looks at a method's name: everything method-specific is in the registry
(:mod:`openrlhf_div.algorithms.registry`), the engine only reads ``method.needs``.

Design choices (documented here, see also :mod:`.generation`):

* **Temperature.** Rollout log-probs, old log-probs, reference log-probs, the training
  forward and DPH's stored base log-probs are all of ``softmax(logits / T)`` with the
  rollout temperature ``T`` (OpenRLHF's convention).
* **Reference log-probs** are computed once per rollout batch (like OpenRLHF's experience
  maker), with the reference model loaded only when ``needs.ref_log_probs``.
* **Old log-probs** are computed right after generation, before reward shaping, because
  the unlikeliness reward ranks responses by their length-normalised old log-prob.
* **Anchor samples** (DPH) ride in the same forward as the online rows of a micro-batch;
  the anchor loss gets its own token count (``L = L_exp + eta L_pef``, each token-mean over
  its own tokens of the optimiser step). No reference model runs for them: their
  ``ref_t`` are the base log-probs stored by ``openrlhf-div presample``.
* **FlowRL's log Z** is a 2-layer MLP on the *detached* mean-pooled last-layer prompt
  states, trained jointly by the same AdamW (its own learning rate ``optim.log_z_lr``).
* **Determinism.** Prompt order, anchor order, sampling and Clip-Cov's token choice each
  use their own seeded stream, all saved in checkpoints; ``--resume`` continues
  bit-for-bit (same next batch, same next loss on the same device and thread count).
"""
from __future__ import annotations

import contextlib
import glob
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from openrlhf_div.algorithms import AnchorInputs, LossInputs
from openrlhf_div.algorithms.heads import make_log_z_head
from openrlhf_div.algorithms._utils import masked_mean

from .config import TrainConfig, dump_config, load_config
from .data import (Cursor, example_key, load_task_examples, max_prompt_tokens, prepare_prompts,
                   render_prompt)
from .generation import (
    encode_prompts,
    pack_sequences,
    response_forward,
    sequence_log_probs,
)
from .evaluation import eval_row, evaluate_policy
from .sampler_registry import open_sampler
from .dtype_probe import resolve_auto_dtype
from .speed import PaddingMeter, bucket_decision, bucketed, shortcut_decision, trim
from .checkpoint import (CorruptCheckpointError, NonFiniteWeightsError, check_weights,  # noqa: F401
                         latest_pointer, read_trainer_state, restore_rng_states, resume_checkpoint, rng_states,
                         weight_norm, write_checkpoint)
from .interrupt import GracefulInterrupt
from .runlog import RunLog
from .step_metrics import StepMetrics
from .models import DTYPES, build_policy, resolve_device, save_model  # noqa: F401 (DTYPES, build_policy: callers)



class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) became NaN/inf; the run stopped before the optimizer step."""


from .realmodel import (absolute_paths, apply_lora,  # noqa: E402
                        lr_factor, merged_for_saving, resolve_num_threads)
from .precision import MasterWeights  # noqa: E402
from .guards import DegenerateMonitor, DegenerateRunError, EmptyAnchorError, degenerate_stats  # noqa: E402,F401
from ..anchor_data import AnchorRecord, check_anchor_temperature, read_pef  # noqa: E402


# =============================================================================== helpers
def fit_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """``[N, R0]`` -> ``[N, width]``: cut padding columns or pad with zeros on the right."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def pad_lists(rows: Sequence[Sequence[float]], width: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.float32)
    return out.to(device)


# =============================================================================== experience
@dataclass
class Experience:
    """One step's training rows (kept groups only), ``G`` contiguous rows per prompt."""

    prompt_ids: List[List[int]]
    response_ids: List[List[int]]
    input_ids: torch.Tensor        # [N, P + R]
    attention_mask: torch.Tensor   # [N, P + R]
    mask: torch.Tensor             # [N, R] float response mask
    old_log_probs: Optional[torch.Tensor]  # [N, R]; None: the on-policy shortcut (the training forward's)
    advantages: torch.Tensor       # [N, R]
    rewards: torch.Tensor          # [N] task rewards
    shaped_rewards: torch.Tensor   # [N]
    correct: torch.Tensor          # [N] bool, method.is_correct(task rewards)
    ref_log_probs: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.prompt_ids)


# =============================================================================== trainer
class Trainer:
    """Build with a :class:`TrainConfig`; ``resume_dir`` continues a run from its latest
    checkpoint. ``hooks`` are called after every micro-batch loss (before ``backward``) with
    a dict holding the exact tensors handed to ``method.loss`` (``online``, ``anchor``,
    ``num_online_tokens``, ``num_anchor_tokens``, ``num_online_seqs``), its result
    (``loss``, ``metrics``), where it happened (``step``, ``epoch``, ``mini_batch``,
    ``micro_batch``, ``rows`` of the step's ``experience``, ``anchors``), ``trainer`` and
    ``train_rng_state`` (the state of ``LossInputs.generator`` before the call).

    ``phase_hooks`` (public, a list) are called as ``hook(name, start, info)`` around the phases
    of a step: ``generation`` (each sampling call; at the end ``info["tokens"]`` = the response
    tokens generated), ``logprobs`` (each old / reference log-prob pass) and ``optimizer`` (the
    master-weight copies, gradient clipping, the optimizer step and the weight check), with
    ``start`` True before and False after. Benchmarks time phases through them."""

    def __init__(self, cfg: TrainConfig, resume_dir: Optional[str] = None,
                 hooks: Sequence[Callable[[Dict[str, Any]], None]] = ()):
        from openrlhf_div.compat.cuda_arch import fix_arch_env
        from openrlhf_div.tasks import get_task

        fix_arch_env(who="openrlhf-div")  # a DeepSpeed op JIT-built in this process must parse it
        self.cfg = cfg
        self.hooks = list(hooks)
        self.phase_hooks: List[Callable[[str, bool, Dict[str, Any]], None]] = []
        torch.set_num_threads(resolve_num_threads(cfg.num_threads))
        self.device = resolve_device(cfg.device)
        self.run_dir = os.path.abspath(resume_dir or cfg.output_dir)
        self.method = cfg.build_method()
        self.needs = self.method.needs
        self.task = get_task(cfg.task, **(cfg.task_options or {}))
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        torch.manual_seed(cfg.seed)

        # the latest checkpoint that verifies against its manifest (a corrupt one: warned, previous used)
        ckpt = resume_checkpoint(self.checkpoint_dir()) if resume_dir else None
        if resume_dir and ckpt is None:
            raise FileNotFoundError(f"--resume {resume_dir}: no checkpoint found under {resume_dir}/checkpoints")
        if not resume_dir and os.path.isdir(os.path.join(self.run_dir, "checkpoints")):
            raise FileExistsError(f"run directory {self.run_dir} already holds checkpoints; continue it with "
                                  f"--resume {self.run_dir} or choose another output_dir")

        # ---- models: the policy, and the reference only if the method asks for it
        m = cfg.model
        # with float32 master weights (or model.dtype auto, decided below) the policy is loaded in
        # float32, copied, then cast (.precision)
        self.model, self.tokenizer = build_policy(cfg, self.device, os.path.join(ckpt, "model") if ckpt else None,
                                                  dtype=torch.float32 if m.master_weights or m.dtype == "auto"
                                                  else None)
        if m.lora_rank > 0 and not hasattr(self.model, "peft_config"):
            self.model = apply_lora(self.model, m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules)
        # model.dtype auto: a timed matmul probe picks float32 or bfloat16 + master weights (.dtype_probe)
        self.dtype_choice = resolve_auto_dtype(cfg, self.model, self.device)  # bfloat16 comes with master weights
        self.master = None
        if m.master_weights:
            self.master = MasterWeights(p for p in self.model.parameters() if p.requires_grad)
            self.model.to(DTYPES[m.dtype])
        if m.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        # ---- the sampler: rollout.backend from the sampler registry (hf: the KV-cache sampler over
        # self.model; vllm: an in-process engine); every sampling call below goes through it
        self.sampler = open_sampler(cfg.rollout.backend, self.model, self.tokenizer, cfg.rollout,
                                    device=self.device, seed=cfg.seed)
        # ---- what may be skipped or regrouped without changing a loss (.speed), said once
        self.on_policy_shortcut, why = shortcut_decision(cfg, self.method, self.model)
        print(f"[openrlhf-div] on-policy shortcut {'on' if self.on_policy_shortcut else 'off'}: {why}"
              + ("; old log-probs are the training forward's, detached (no separate forward)"
                 if self.on_policy_shortcut else ""), flush=True)
        self.length_buckets, why = bucket_decision(cfg, self.method)
        print(f"[openrlhf-div] length buckets in training {'on' if self.length_buckets else 'off'}: {why}", flush=True)
        self._pad = {"logprob": PaddingMeter(), "train": PaddingMeter()}
        self.ref_model = None
        if self.needs.ref_log_probs:
            self.ref_model, _ = build_policy(cfg, self.device)
            self.ref_model.eval().requires_grad_(False)
        self.log_z_head = None
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        params = [{"params": [self.master.master_of(p) for p in trainable] if self.master else trainable}]
        if self.needs.prompt_hidden:
            self.log_z_head = make_log_z_head(self.method.hparams.get("log_z_head", "small_detached"),
                                              self.model.config.hidden_size).to(self.device)
            params.append({"params": list(self.log_z_head.parameters()),
                           "lr": cfg.optim.log_z_lr or cfg.optim.learning_rate})
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(params, lr=o.learning_rate, betas=tuple(o.adam_betas), eps=o.adam_eps,
                                           weight_decay=o.weight_decay)
        self._base_lrs = [g["lr"] for g in self.optimizer.param_groups]

        # ---- data
        train_path, anchor_path = self._data_paths()
        from_presample = train_path != cfg.data.train  # D_exp: rows already normalised by presample
        max_tok = max_prompt_tokens(cfg, self.model, cfg.rollout.max_new_tokens)
        max_chars = max_tok * 64 if max_tok else None
        self.train_examples, train_summary = load_task_examples(
            cfg, train_path, split=None if from_presample else cfg.data.split, normalized=from_presample,
            max_prompt_chars=max_chars)
        self._prompt_cache = prepare_prompts(self.task, self.tokenizer, self.train_examples, train_summary, cfg.data,
                                             max_tok)
        self.eval_examples = []
        if cfg.data.eval:
            self.eval_examples, eval_summary = load_task_examples(cfg, cfg.data.eval, split=cfg.data.eval_split,
                                                                  max_prompt_chars=max_chars)
            if cfg.eval.max_prompts is not None:
                self.eval_examples = self.eval_examples[:cfg.eval.max_prompts]
            eval_tok = max_prompt_tokens(cfg, self.model, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens)
            prepare_prompts(self.task, self.tokenizer, self.eval_examples, eval_summary, cfg.data, eval_tok)
        self.prompt_cursor = Cursor(self.train_examples, seed=cfg.seed)
        self.anchor_cursor = None
        self.anchor_samples: List[AnchorRecord] = []
        if self.needs.anchor_batch:
            self.anchor_samples = read_pef(anchor_path, method=self.method.name)  # EmptyAnchorError when empty
            check_anchor_temperature(anchor_path, cfg.rollout.temperature)
            self.anchor_cursor = Cursor(self.anchor_samples, seed=cfg.seed + 1)

        # ---- random streams (all checkpointed)
        self.gen_rng = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.train_rng = torch.Generator(device="cpu").manual_seed(cfg.seed + 2)
        self.step = 0
        self.log = RunLog(self.run_dir, tensorboard=cfg.logging.tensorboard, run_name=self.method.name,
                          config={"method": self.method.describe(), "seed": cfg.seed})
        self._degenerate = DegenerateMonitor(cfg.optim.stop_after_degenerate_steps)  # restored on resume
        if ckpt:
            self._load_checkpoint(ckpt)  # the policy's weights came from the checkpoint: the sampler has them
        # reference for the exploding-weights check after every optimizer step
        self._start_weight_norm = weight_norm(self._checked_params())
        self.interrupt = GracefulInterrupt()

    # ------------------------------------------------------------------ data plumbing
    def _data_paths(self):
        d = self.cfg.data
        train, anchor = d.train, d.anchor
        if self.needs.anchor_batch:
            wanted = ([] if anchor is not None else ["d_pef.jsonl"]) + (["d_exp.jsonl"] if d.train_on_exp else [])
            missing = [f for f in wanted if d.presample_dir and not os.path.isfile(os.path.join(d.presample_dir, f))]
            if missing:  # name the setting (a folder one level off gave "dataset not found: .../d_exp.jsonl")
                below = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(d.presample_dir, "*", missing[0])))
                raise ValueError(f"data.presample_dir={d.presample_dir}: no {missing[0]} there (it is the folder "
                                 "`openrlhf-div presample` wrote, holding d_pef.jsonl and d_exp.jsonl)"
                                 + (f"; did you mean data.presample_dir={below[0]}?" if below else ""))
            if anchor is None and d.presample_dir:
                anchor = os.path.join(d.presample_dir, "d_pef.jsonl")
            if anchor is None:
                raise ValueError(f"method {self.method.name!r} needs an anchor batch from D_pef: run "
                                 "`openrlhf-div presample` and set data.presample_dir (or data.anchor)")
            if d.presample_dir and d.train_on_exp:
                train = os.path.join(d.presample_dir, "d_exp.jsonl")
        if train is None:
            raise ValueError("data.train is required (a JSONL of {prompt, label, source, id} examples)")
        return train, anchor

    def prompt_ids(self, example: Dict[str, Any]) -> List[int]:
        key = example_key(example)
        if key not in self._prompt_cache:
            text = render_prompt(self.task, self.tokenizer, example, self.cfg.data)
            self._prompt_cache[key] = encode_prompts(self.tokenizer, [text])[0]
        return self._prompt_cache[key]

    @contextlib.contextmanager
    def phase(self, name: str):
        """Calls :attr:`phase_hooks` before and after the block; yields the ``info`` dict they get."""
        info: Dict[str, Any] = {}
        for h in self.phase_hooks:
            h(name, True, info)
        try:
            yield info
        finally:
            for h in self.phase_hooks:
                h(name, False, info)

    # ------------------------------------------------------------------ forward helpers
    @torch.no_grad()
    def _no_grad_log_probs(self, model, input_ids, attention_mask, response_mask) -> torch.Tensor:
        """``[N, R]`` log-probs in micro-batches of ``optim.micro_batch_size`` rows; with
        ``optim.length_buckets`` rows of similar length go together, each micro-batch cut to its
        own widest row (:func:`.speed.trim`; exact)."""
        mb, N, R = self.cfg.optim.micro_batch_size, input_ids.shape[0], response_mask.shape[1]
        if not self.cfg.optim.length_buckets:
            self._pad["logprob"].add(attention_mask)
            outs = [sequence_log_probs(model, input_ids[i:i + mb], attention_mask[i:i + mb],
                                       response_mask[i:i + mb], temperature=self.cfg.rollout.temperature)
                    for i in range(0, N, mb)]
            return torch.cat(outs, 0)
        order = torch.as_tensor(bucketed(range(N), attention_mask.sum(1).tolist()), device=input_ids.device)
        out = torch.zeros(N, R, dtype=torch.float32, device=input_ids.device)
        for i in range(0, N, mb):
            idx = order[i:i + mb]
            ids, attn, rmask = trim(input_ids[idx], attention_mask[idx], response_mask[idx])
            self._pad["logprob"].add(attn)
            lp = sequence_log_probs(model, ids, attn, rmask, temperature=self.cfg.rollout.temperature)
            out[idx, :lp.shape[1]] = lp.float()
        return out

    # ------------------------------------------------------------------ rollouts
    @property
    def backend(self) -> str:
        """The registered name of the sampler in use (``hf`` or ``vllm``; ``auto`` resolved)."""
        return self.sampler.name

    def sample(self, prompts, **kw):
        """``rollout.backend``'s sampler (:mod:`.sampler_registry`): same arguments and
        :class:`.generation.GenerationOutput` for every backend."""
        return self.sampler.generate(prompts, **kw)

    def make_experience(self):
        """Sample, score, shape, filter and compute advantages for one RL step.

        Returns ``(experience or None, rollout stats)``; ``None`` when dynamic sampling kept
        no group within its tries (the step then makes no update)."""
        cfg, method = self.cfg, self.method
        B, G, r = cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout
        kept: List[Dict[str, Any]] = []
        n_groups, tries = 0, 0
        all_rewards, all_task_correct, all_lengths, all_finished = [], [], [], []
        t_gen = c_gen = 0.0
        while True:
            examples = self.prompt_cursor.next(B - n_groups)
            t0, c0 = time.perf_counter(), time.process_time()
            self.model.eval()
            with self.phase("generation") as ph:
                gen = self.sample([self.prompt_ids(ex) for ex in examples], n_samples=G,
                                  max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                  generator=self.gen_rng, batch_size=r.generation_batch_size)
                ph["tokens"] = int(gen.response_lengths.sum())
            t_gen += time.perf_counter() - t0
            c_gen += time.process_time() - c0
            mask = gen.response_mask.float()
            if self.on_policy_shortcut:  # the training forward gives them; the rollout side does not read them
                old = None
            elif r.recompute_old_log_probs:
                with self.phase("logprobs"):
                    old = self._no_grad_log_probs(self.model, gen.input_ids, gen.attention_mask, gen.response_mask)
            else:
                old = gen.log_probs
            self.model.train()
            results = self.task.reward_results(list(gen.texts), [examples[i // G].get("label")
                                                                 for i in range(len(gen.texts))])
            rewards = torch.tensor([float(x.reward) for x in results], dtype=torch.float32)
            # (shortcut: the method's rollout side reads no old log-probs - .speed checked - and gets the
            # sampler's for their shape)
            ro = method.rollout(rewards, G, old_log_probs=gen.log_probs if old is None else old, mask=mask,
                                lengths=gen.response_lengths)
            all_rewards.append(rewards)
            all_task_correct += [bool(x.correct) for x in results]
            all_lengths.append(gen.response_lengths.float().cpu())
            all_finished.append(gen.finished.float().cpu())
            tries += 1
            for g in torch.nonzero(ro.keep).flatten().tolist():  # advantages are per group
                rows = list(range(g * G, (g + 1) * G))
                kept.append({"prompt_ids": [gen.prompt_ids[i] for i in rows],
                             "response_ids": [gen.response_ids[i] for i in rows],
                             "old": None if old is None else old[rows].cpu(), "rewards": rewards[rows],
                             "shaped": ro.rewards[rows],
                             "correct": ro.correct[rows], "adv": ro.advantages[rows].cpu()})
            n_groups = len(kept)
            if n_groups >= B or tries >= r.dynamic_sampling_max_tries:
                break
        kept = kept[:B]
        rewards_all = torch.cat(all_rewards)
        stats = {"reward_mean": float(rewards_all.mean()), "reward_std": float(rewards_all.std()) if rewards_all.numel() > 1 else 0.0,
                 "pass_rate": float(np.mean(all_task_correct)),
                 "response_length": float(torch.cat(all_lengths).mean()),
                 "truncated_frac": 1.0 - float(torch.cat(all_finished).mean()),
                 "kept_groups": float(len(kept)), "generation_rounds": float(tries), "time_generate": t_gen,
                 "cpu_time_generate": c_gen}
        stats.update(degenerate_stats(rewards_all, torch.cat(all_finished), G))
        if not kept:
            return None, stats

        prompt_ids = [p for k in kept for p in k["prompt_ids"]]
        response_ids = [x for k in kept for x in k["response_ids"]]
        ids, attn, rmask = pack_sequences(prompt_ids, response_ids, self.tokenizer.pad_token_id, self.device)
        R = rmask.shape[1]
        mask = rmask.float()
        old = None if self.on_policy_shortcut else torch.cat([fit_width(k["old"], R) for k in kept]).to(self.device)
        rewards = torch.cat([k["rewards"] for k in kept])
        shaped = torch.cat([k["shaped"] for k in kept])
        correct = torch.cat([k["correct"] for k in kept])
        adv = torch.cat([fit_width(k["adv"], R) for k in kept]).to(self.device)
        ref = None
        if self.needs.ref_log_probs:
            with self.phase("logprobs"):
                ref = self._no_grad_log_probs(self.ref_model, ids, attn, rmask)
        stats["shaped_reward_mean"] = float(shaped.mean())
        stats["advantage_abs_mean"] = float(masked_mean(adv.abs(), mask))
        return Experience(prompt_ids, response_ids, ids, attn, mask, old, adv, rewards, shaped,
                          correct.to(self.device), ref), stats

    # ------------------------------------------------------------------ optimisation
    def optimise(self, exp: Experience) -> Dict[str, float]:
        """``ppo_epochs`` passes; each splits the rows into ``mini_batches`` optimiser steps,
        each step into micro-batches of ``micro_batch_size`` online rows (plus their share of
        the step's anchor samples)."""
        o = self.cfg.optim
        lr_f = lr_factor(self.step, o.steps, o.lr_schedule, o.warmup_steps, o.min_lr_ratio)
        for group, base_lr in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base_lr * lr_f
        acc = StepMetrics()
        step_anchors = 0
        for epoch in range(o.ppo_epochs):
            perm = torch.randperm(len(exp), generator=self.train_rng)
            for mb_i, rows in enumerate(torch.tensor_split(perm, o.mini_batches)):
                rows = rows.tolist()
                if not rows:
                    continue
                anchors = []
                if self.anchor_cursor is not None:
                    anchors = self.anchor_cursor.next(self.cfg.anchors_per_mini_batch(len(rows), mb_i))
                    if epoch == 0:  # the rollout step's anchors (the Ray engine's rollout/num_anchor_samples)
                        step_anchors += len(anchors)
                if self.length_buckets:  # micro-batches of rows of similar length (.speed; same loss)
                    rows = bucketed(rows, exp.attention_mask.sum(1).tolist())
                    anchors = sorted(anchors, key=lambda a: len(a.prompt_ids) + len(a.response_ids))
                n_on_tok = float(exp.mask[rows].sum())
                n_anc_tok = float(sum(len(a.response_ids) for a in anchors))
                n_micro = max(1, math.ceil(len(rows) / o.micro_batch_size))
                anchor_parts = self._anchor_parts(anchors, n_micro)
                self.optimizer.zero_grad(set_to_none=True)
                for k in range(n_micro):
                    m_rows = rows[k * o.micro_batch_size:(k + 1) * o.micro_batch_size]
                    m_anchors = anchor_parts[k]
                    loss, metrics = self.micro_step(exp, m_rows, m_anchors, n_on_tok, n_anc_tok, float(len(rows)),
                                                    where=dict(epoch=epoch, mini_batch=mb_i, micro_batch=k),
                                                    num_anchor_seqs=float(len(anchors)))
                    loss.backward()
                    acc.add_micro_batch(metrics)
                with self.phase("optimizer"):
                    if self.master is not None:  # bfloat16 gradients -> the float32 master copies
                        self.master.grads_to_master()
                    params = [p for g in self.optimizer.param_groups for p in g["params"]]
                    max_norm = o.max_grad_norm if o.max_grad_norm > 0 else float("inf")
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
                    if not math.isfinite(grad_norm):
                        raise NonFiniteLossError(self._nonfinite_msg("gradient norm", grad_norm, epoch, mb_i, None))
                    self.optimizer.step()
                    if self.master is not None:
                        self.master.master_to_model()
                    self._check_weights(f"at step {self.step + 1} (epoch {epoch}, mini-batch {mb_i})")
                self._weights_changed = True
                acc.add_mean("grad_norm", grad_norm)
                acc.end_optimizer_step()
        out = acc.result()
        out["lr"] = float(self._base_lrs[0] * lr_f)
        if self.anchor_cursor is not None:
            out["anchor_samples"] = float(step_anchors)  # D_pef samples in this rollout step (not per micro-batch)
        return out

    def _anchor_parts(self, anchors: List[AnchorRecord], n_micro: int) -> List[List[AnchorRecord]]:
        """The step's anchors per micro-batch: round-robin, or, for ``micro-batch-token-mean``,
        contiguous blocks of whole ``micro_batch_seqs`` groups (the authors' anchor micro-batches)."""
        if self.method.aggregation != "micro-batch-token-mean":
            if self.length_buckets:  # contiguous blocks of the length-sorted anchors, like the online rows
                per = math.ceil(len(anchors) / n_micro) if anchors else 0
                return [anchors[k * per:(k + 1) * per] for k in range(n_micro)]
            return [anchors[k::n_micro] for k in range(n_micro)]
        k = int(self.method.hparams["micro_batch_seqs"])
        groups = [anchors[i:i + k] for i in range(0, len(anchors), k)]
        per = math.ceil(len(groups) / n_micro) if groups else 0
        return [[a for g in groups[j * per:(j + 1) * per] for a in g] for j in range(n_micro)]

    def micro_step(self, exp: Experience, rows: List[int], anchors: List[AnchorRecord], num_online_tokens: float,
                   num_anchor_tokens: float, num_online_seqs: float, where: Dict[str, int],
                   num_anchor_seqs: Optional[float] = None):
        """One forward over ``rows`` of ``exp`` and ``anchors``; returns ``method.loss(...)``."""
        n_on = len(rows)
        prompt_ids = [exp.prompt_ids[i] for i in rows] + [a.prompt_ids for a in anchors]
        response_ids = [exp.response_ids[i] for i in rows] + [a.response_ids for a in anchors]
        ids, attn, rmask = pack_sequences(prompt_ids, response_ids, self.tokenizer.pad_token_id, self.device)
        self._pad["train"].add(attn)
        R = rmask.shape[1]
        entropy_mode = True if self.needs.entropy else ("detached" if self.cfg.logging.entropy else False)
        fo = response_forward(self.model, ids, attn, rmask, temperature=self.cfg.rollout.temperature,
                              return_entropy=entropy_mode, return_prompt_hidden=self.needs.prompt_hidden)
        mask = rmask.float()
        online = anchor = None
        if n_on:
            idx = torch.as_tensor(rows, device=self.device)
            online = LossInputs(
                log_probs=fo.log_probs[:n_on],
                old_log_probs=(fo.log_probs[:n_on].detach() if exp.old_log_probs is None  # on-policy shortcut
                               else fit_width(exp.old_log_probs[idx], R)),
                advantages=fit_width(exp.advantages[idx], R), mask=mask[:n_on], correct=exp.correct[idx],
                entropy=fo.entropy[:n_on] if self.needs.entropy else None,
                ref_log_probs=fit_width(exp.ref_log_probs[idx], R) if self.needs.ref_log_probs else None,
                log_z=self.log_z_head(fo.prompt_hidden[:n_on]) if self.log_z_head is not None else None,
                generator=self.train_rng)
        if anchors:
            anchor = AnchorInputs(log_probs=fo.log_probs[n_on:],
                                  ref_log_probs=pad_lists([a.ref_log_probs for a in anchors], R, self.device),
                                  mask=mask[n_on:])
        rng_state = self.train_rng.get_state() if self.hooks else None
        loss, metrics = self.method.loss(online=online, anchor=anchor, num_online_tokens=num_online_tokens,
                                         num_anchor_tokens=num_anchor_tokens, num_online_seqs=num_online_seqs,
                                         num_anchor_seqs=num_anchor_seqs)
        metrics = dict(metrics)
        if fo.entropy is not None and n_on:
            metrics["entropy"] = float(masked_mean(fo.entropy[:n_on].detach(), mask[:n_on]))
        for h in self.hooks:
            h(dict(step=self.step + 1, online=online, anchor=anchor, num_online_tokens=num_online_tokens,
                   num_anchor_tokens=num_anchor_tokens, num_online_seqs=num_online_seqs,
                   num_anchor_seqs=num_anchor_seqs, loss=loss,
                   metrics=metrics, rows=list(rows), anchors=anchors, method=self.method, experience=exp,
                   trainer=self, train_rng_state=rng_state, **where))
        if not torch.isfinite(loss):
            raise NonFiniteLossError(self._nonfinite_msg("loss", float(loss), where["epoch"], where["mini_batch"],
                                                         where["micro_batch"]))
        return loss, metrics

    def _nonfinite_msg(self, what, val, epoch, mb, micro):
        last = self.latest_checkpoint()
        at = f"epoch {epoch}, mini-batch {mb}" + (f", micro-batch {micro}" if micro is not None else "")
        return (f"non-finite {what} ({val}) at step {self.step + 1} ({at}); stopped before the optimizer step. "
                f"Last good checkpoint: {last or 'none yet'}. Try a lower optim.learning_rate or a smaller "
                f"method hyperparameter, and resume with --resume {self.run_dir}")

    # ------------------------------------------------------------------ one step
    def train_step(self) -> Dict[str, float]:
        """One RL step: :meth:`make_experience` then :meth:`optimise`; returns its metrics."""
        t0, c0 = time.perf_counter(), time.process_time()
        exp, stats = self.make_experience()
        t1, c1 = time.perf_counter(), time.process_time()
        self._weights_changed = False
        self.sampler.sleep()  # GPU vLLM: free its memory while the trainer runs (hf: nothing to free)
        if exp is not None:
            stats.update(self.optimise(exp))
        else:
            stats["skipped"] = 1.0  # dynamic sampling found no informative group
        if self._weights_changed or not self.sampler.awake:
            self.sampler.sync(self.model)  # the new weights reach the sampler before the next rollout
        stats["time_weight_sync"] = self.sampler.push_seconds
        for phase, meter in self._pad.items():  # padded share of the computed positions, this step
            stats[f"padded_share_{phase}"] = meter.share
            stats[f"useful_tokens_{phase}"] = float(meter.useful)
            self._pad[phase] = PaddingMeter()
        self.step += 1
        t2 = time.perf_counter()
        n = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        stats.update(step=self.step, time_experience=t1 - t0, time_train=t2 - t1, time_step=t2 - t0,
                     cpu_time_train=time.process_time() - c1,
                     cpu_time_step=time.process_time() - c0, samples_per_s=n / max(t2 - t0, 1e-9))
        return stats

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> Optional[Dict[str, Any]]:
        """Evaluate the current policy on the held-out prompts (:mod:`.evaluation`): writes
        ``eval.json`` (the latest evaluation), appends a row to ``eval.jsonl`` and returns it."""
        if not self.eval_examples:
            return None
        res = evaluate_policy(self.model, self.tokenizer, self.task, self.eval_examples, self.cfg,
                              run_dir=self.run_dir, name=self.method.name, step=self.step, sampler=self.sampler)
        if self.step == 0:  # the initial policy's evaluation: `compare` uses it as the base
            import shutil

            shutil.copyfile(os.path.join(self.run_dir, "eval.json"), os.path.join(self.run_dir, "eval_step0.json"))
        row = eval_row(self.step, res)
        self.log.append("eval.jsonl", row)
        self.log.scalars("eval", row, self.step)
        if self.cfg.logging.progress:  # one line per evaluation (eval.every N: a periodic pass@k line)
            print(passk_line(row), flush=True)
        return row

    # ------------------------------------------------------------------ checkpoints
    def _checked_params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _check_weights(self, where: str) -> float:
        """Non-finite or exploding weights stop the run before anything is checkpointed
        (:func:`.checkpoint.check_weights`)."""
        return check_weights(self._checked_params(), self._start_weight_norm, self.cfg.checkpoint.max_weight_growth,
                             where, self.latest_checkpoint(), self.run_dir)

    def checkpoint_dir(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    def latest_checkpoint(self) -> Optional[str]:
        return latest_pointer(self.checkpoint_dir())

    def save_checkpoint(self) -> str:
        """Model, optimizer, log Z head, every RNG state and the data positions
        (:func:`.checkpoint.write_checkpoint`: atomic, with a manifest). Refuses non-finite weights."""
        self._check_weights(f"before saving the checkpoint of step {self.step}")
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "master_weights": self.master.state_dict() if self.master is not None else None,
            "log_z_head": self.log_z_head.state_dict() if self.log_z_head is not None else None,
            "rng": rng_states(self.gen_rng, self.train_rng),
            "prompt_cursor": self.prompt_cursor.state_dict(),
            "anchor_cursor": self.anchor_cursor.state_dict() if self.anchor_cursor is not None else None,
            "degenerate_monitor": self._degenerate.state_dict(),
            "method": self.method.describe(),
        }
        return write_checkpoint(self.checkpoint_dir(), self.step, self.model, self.tokenizer, state,
                                self.cfg.checkpoint.keep)

    def _load_checkpoint(self, path: str) -> None:
        st = read_trainer_state(path)
        self.step = int(st["step"])
        self.optimizer.load_state_dict(st["optimizer"])
        if self.master is not None and st.get("master_weights") is not None:
            self.master.load_state_dict(st["master_weights"])  # the exact float32 values, not the bf16 model's
        if self.log_z_head is not None and st.get("log_z_head") is not None:
            self.log_z_head.load_state_dict(st["log_z_head"])
        restore_rng_states(st["rng"], self.gen_rng, self.train_rng)
        self.prompt_cursor.load_state_dict(st["prompt_cursor"])
        if self.anchor_cursor is not None and st.get("anchor_cursor") is not None:
            self.anchor_cursor.load_state_dict(st["anchor_cursor"])
        # metrics logged after this checkpoint belong to steps that will be redone
        for fname in ("metrics.jsonl", "eval.jsonl"):
            self.log.truncate(fname, self.step)
        if st.get("degenerate_monitor") is not None:
            self._degenerate.load_state_dict(st["degenerate_monitor"])
        else:  # a checkpoint from before the counters were saved: count them from the log
            from .checkpoint import read_jsonl_rows

            p = os.path.join(self.run_dir, "metrics.jsonl")
            self._degenerate.rebuild(read_jsonl_rows(p)[0] if os.path.exists(p) else [])

    def _write_run_info(self, resumed: bool) -> None:
        info = {"seed": self.cfg.seed, "device": str(self.device), "num_threads": torch.get_num_threads(),
                "method": self.method.describe(), "n_train_examples": len(self.train_examples),
                "n_eval_examples": len(self.eval_examples), "n_anchor_samples": len(self.anchor_samples),
                "reference_model_loaded": self.ref_model is not None, "rollout_backend": self.backend,
                "on_policy_shortcut": self.on_policy_shortcut, "length_buckets": self.length_buckets,
                "dtype": self.cfg.model.dtype, "master_weights": self.cfg.model.master_weights,
                "dtype_choice": self.dtype_choice, "experiment": self.cfg.experiment}
        from openrlhf_div.engines.provenance import settings_of

        info["settings"] = settings_of(self.cfg)  # what reaches training, the keys every engine records
        recorded = absolute_paths(self.cfg)
        info["plugins"] = list(recorded.plugins)
        self.log.write_run_info(dump_config(recorded), info, self.step if resumed else None)

    # ------------------------------------------------------------------ the loop
    def train(self, steps: Optional[int] = None) -> Dict[str, Any]:
        """Run until ``optim.steps`` (or ``steps``) RL steps are done; returns the last
        metrics and evaluation. Ctrl-C finishes the current step and checkpoints."""
        from openrlhf_div.progress import progress_bar

        total = self.cfg.optim.steps if steps is None else steps
        self._write_run_info(self.step > 0)
        last_eval = None
        last: Dict[str, float] = {}
        try:
            with self.interrupt:
                if self.step == 0 and self.cfg.eval.at_start:
                    last_eval = self.evaluate()
                bar = progress_bar(total=total, initial=min(self.step, total), desc=f"train {self.method.name}",
                                   unit="step", disable=not self.cfg.logging.progress, dynamic_ncols=True)
                while self.step < total:
                    last = self.train_step()
                    try:
                        self._degenerate.update(last, self.step)
                    finally:
                        self.log.append("metrics.jsonl", last)
                    self.log.scalars("train", last, self.step)
                    bar.set_postfix(progress_figures(last, self.step))
                    bar.update(1)
                    e = self.cfg.eval.every
                    if e and self.step % e == 0 and self.step < total:
                        last_eval = self.evaluate()
                    c = self.cfg.checkpoint.every
                    if (c and self.step % c == 0) or self.interrupt.requested:
                        self.save_checkpoint()
                    if self.interrupt.requested:
                        bar.close()
                        print(f"[openrlhf-div] interrupted after step {self.step}; checkpoint written. Continue "
                              f"with `openrlhf-div train --resume {self.run_dir}`")
                        raise KeyboardInterrupt
                bar.close()
            if not (last_eval and last_eval.get("step") == self.step):
                last_eval = self.evaluate()  # the final policy
            latest = self.latest_checkpoint()
            if latest is None or not latest.endswith(f"step_{self.step:06d}"):
                self.save_checkpoint()
            save_model(merged_for_saving(self.model), self.tokenizer, os.path.join(self.run_dir, "final_model"))
        finally:
            self.log.close()
        return {"metrics": last, "eval": last_eval, "run_dir": self.run_dir}

    def close_sampler(self) -> None:
        """Release the sampler (vLLM: shut its engine down; hf: nothing held). Sampling afterwards
        is the backend's to refuse (vLLM raises)."""
        if getattr(self, "sampler", None) is not None:
            self.sampler.close()


def progress_figures(m: Dict[str, Any], step: int) -> Dict[str, str]:
    """The progress line's figures of a step's metrics (:func:`openrlhf_div.progress.step_figures`,
    the one formatter of every engine)."""
    from openrlhf_div.progress import step_figures

    return step_figures(m, step)


def passk_line(row: Dict[str, Any]) -> str:
    """The pass@k line of an evaluation (:func:`openrlhf_div.progress.passk_line`)."""
    from openrlhf_div.progress import passk_line as line

    return line(row)


# =============================================================================== entry point
def _load_recorded_plugins(cfg_path: str, run_dir: str, overrides: Sequence[str] = ()) -> None:
    """The plug-ins a run recorded (its config.yaml's ``plugins:``), loaded before its method is
    resolved; one that cannot be loaded here is named in one line, and so is a method no plug-in
    registered (a run from before plug-ins were recorded) (issue 43 item 2)."""
    from openrlhf_div.algorithms import list_methods
    from openrlhf_div.config import ConfigError, load
    from openrlhf_div.plugins import PluginError, config_plugins, load_plugins

    data = load(cfg_path, overrides)
    for spec in config_plugins(data.get("plugins"), cfg_path):
        try:
            load_plugins([spec])
        except (PluginError, ImportError) as exc:
            raise PluginError(f"--resume {run_dir}: the run was trained with the plug-in {spec!r} (its config.yaml's "
                              f"plugins:), which cannot be loaded here: {exc}") from None
    method = data.get("method")
    name = str(method.get("name") if isinstance(method, dict) else method or "")
    if name and name not in list_methods():
        raise ConfigError(f"--resume {run_dir}: unknown method {name!r} (its config.yaml); if a plug-in registered it, "
                          f"load it again: openrlhf-div --plugin MODULE_OR_FILE train --resume {run_dir}")


def train(config: Optional[str] = None, overrides: Sequence[str] = (), resume: Optional[str] = None,
          hooks: Sequence[Callable] = (), cfg: Optional[TrainConfig] = None) -> Dict[str, Any]:
    """Train from a YAML ``config`` (+ ``key=value`` overrides), or continue ``resume``
    (its saved ``config.yaml``; overrides still apply, e.g. ``optim.steps=200``)."""
    if resume is not None:
        cfg_path = os.path.join(resume, "config.yaml")
        if not os.path.exists(cfg_path):
            raise FileNotFoundError(f"--resume {resume}: no config.yaml there (is it a run directory?)")
        _load_recorded_plugins(cfg_path, resume, overrides)
        cfg = load_config(cfg_path, overrides)
    elif cfg is None:
        cfg = load_config(config, overrides)
    trainer = Trainer(cfg, resume_dir=resume, hooks=hooks)
    try:
        return trainer.train()
    finally:
        trainer.close_sampler()
