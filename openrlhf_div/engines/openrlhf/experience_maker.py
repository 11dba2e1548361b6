"""OpenRLHF's ``RemoteExperienceMaker`` with the method's advantages and ``D_pef`` anchors.

What stays OpenRLHF's: splitting the rollout into micro-batches, the remote forwards (old
log-probs from the policy actor for every rollout sample; reference log-probs only when the
reference actor exists, i.e. when the method declares ``needs.ref_log_probs``).

What is ours:

* :meth:`compute_advantages_and_returns` gathers the whole rollout batch in prompt order and
  calls :func:`~openrlhf_div.engines.openrlhf.advantages.rollout_advantages` (``Method.rollout``:
  reward shaping, dynamic sampling, estimator, DS reshaping -- the local engine's pipeline), then
  scatters the ``[N, T]`` advantages back with the per-row flags of the engine contract
  (:func:`openrlhf_div.engines.contract.mark_rollout_rows`);
* :meth:`make_experience_batch` then appends ``B_pef`` anchor rows from ``D_pef``
  (``--div.anchor_batch_size``, default ``online / --div.anchor_ratio``), spread round-robin
  over the micro-batches so every data-parallel rank gets its share.
"""
from __future__ import annotations

import itertools
from typing import List, Optional

import torch

from openrlhf_div.algorithms.registry import Method
from openrlhf_div.compat.flash_attn_standin import install as _install_flash_attn_standin

_install_flash_attn_standin()

from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402

from . import anchors as _anchors  # noqa: E402
from .advantages import rollout_advantages  # noqa: E402
from ..contract import mark_rollout_rows  # noqa: E402
from ..flags import div_namespace, method_from_args  # noqa: E402
from ..anchor_data import AnchorSampler, anchor_count, check_anchor_temperature, read_pef  # noqa: E402


class DivExperienceMaker(RemoteExperienceMaker):
    """See the module docstring. ``method`` defaults to the one in ``strategy.args.div``."""

    def __init__(self, *args, method: Optional[Method] = None, anchor_pool: Optional[AnchorSampler] = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.method = method if method is not None else method_from_args(self.args)
        div = div_namespace(self.args)
        self.anchor_batch_size = getattr(div, "anchor_batch_size", None)
        self.anchor_ratio = float(getattr(div, "anchor_ratio", 8.0) or 8.0)
        if anchor_pool is None and self.method.needs.anchor_batch:
            if not getattr(div, "anchor_data", None):
                raise ValueError(f"method {self.method.name!r} needs D_pef anchors: pass --div.anchor_data PATH")
            seed = getattr(div, "anchor_seed", None)
            if seed is None:
                seed = getattr(getattr(self.args, "train", None), "seed", 0)
            temperature = getattr(getattr(self.args, "rollout", None), "temperature", None)
            if temperature is not None:
                check_anchor_temperature(div.anchor_data, temperature, "--rollout.temperature")
            anchor_pool = AnchorSampler(read_pef(div.anchor_data, method=self.method.name,
                                                 tau_flag="--presample.tau"), seed=seed)
        self.anchor_pool = anchor_pool
        self.last_num_anchors = 0

    # ----------------------------------------------------------------- anchors
    @torch.no_grad()
    def make_experience_batch(self, rollout_samples) -> List[Experience]:
        experiences = super().make_experience_batch(rollout_samples)
        return self.attach_anchors(experiences)

    def attach_anchors(self, experiences: List[Experience]) -> List[Experience]:
        if not self.method.needs.anchor_batch:
            self.last_num_anchors = 0
            return experiences
        num_online = sum(int(e.sequences.shape[0]) for e in experiences)
        n = anchor_count(num_online, self.anchor_batch_size, self.anchor_ratio)
        records = self.anchor_pool.draw(n)
        self._check_token_ids(records)
        self.last_num_anchors = n
        max_len = getattr(getattr(self.args, "data", None), "max_len", None)
        return _anchors.distribute(experiences, records, self.tokenizer.pad_token_id, max_len)

    def _check_token_ids(self, records) -> None:
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        if vocab is None:
            return
        for r in records:
            top = max(max(r.prompt_ids), max(r.response_ids))
            if top >= vocab:
                raise ValueError(
                    f"D_pef record {r.id!r} has token id {top} >= the tokenizer's {vocab} ids: "
                    "it was pre-sampled with another tokenizer; rerun presample_ray with this model"
                )

    # ----------------------------------------------------------------- advantages
    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences: List[Experience]) -> List[Experience]:
        """Registry advantages for the whole rollout batch (replaces OpenRLHF's estimators)."""
        group = int(self.args.rollout.n_samples_per_prompt)
        rows = [int(e.sequences.shape[0]) for e in experiences]
        order = torch.tensor(list(itertools.chain.from_iterable(e.index for e in experiences)))
        N = int(order.numel())
        if sorted(order.tolist()) != list(range(N)):
            raise ValueError("experience indices must be a permutation of 0..N-1 (OpenRLHF rollout order)")
        width = max(int(e.action_mask.shape[1]) for e in experiences)

        def gather(get, fill=0.0):
            out = torch.full((N, width), fill, dtype=torch.float32)
            start = 0
            for e, n in zip(experiences, rows):
                t = get(e).float()
                out[order[start:start + n], :t.shape[1]] = t
                start += n
            return out

        old = gather(lambda e: e.action_log_probs)
        mask = gather(lambda e: e.action_mask)
        rewards = torch.empty(N)
        lengths = torch.empty(N)
        start = 0
        for e, n in zip(experiences, rows):
            idx = order[start:start + n]
            rewards[idx] = e.rewards.float().reshape(-1)
            lengths[idx] = e.response_length.float().reshape(-1)
            start += n

        res = rollout_advantages(self.method, rewards, old, mask, group, lengths=lengths)

        start = 0
        for e, n in zip(experiences, rows):
            idx = order[start:start + n]
            w = int(e.action_mask.shape[1])
            adv = res.advantages[idx, :w]
            e.advantages = adv
            e.returns = adv.clone()
            e.action_mask = res.mask[idx, :w].to(e.action_mask.dtype)
            e.kl = None
            e.info["return"] = res.shaped_rewards[idx]
            mark_rollout_rows(e.info, res.correct[idx], res.keep[idx])
            start += n
        return experiences
