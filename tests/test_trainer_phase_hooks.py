"""The local trainer's ``phase_hooks`` (what benchmarks time phases through): every phase of a step
is announced before and after, in order, with the generated token count at the end of generation."""
from __future__ import annotations

import torch

from openrlhf_div.engines.local.config import load_config
from openrlhf_div.engines.local.trainer import Trainer

from helpers import local_overrides, write_copy_last_data

torch.set_num_threads(1)


def test_phase_hooks_bracket_generation_logprobs_and_the_optimizer(tmp_path):
    data = write_copy_last_data(tmp_path)
    # rkl: old log-probs recomputed (the on-policy shortcut off) and a reference pass (two log-prob
    # phases per step)
    cfg = load_config(None, local_overrides(data, tmp_path / "run", "rkl", ["rollout.recompute_old_log_probs=true",
                                                                          "rollout.on_policy_shortcut=false"]))
    tr = Trainer(cfg)
    events = []
    tr.phase_hooks.append(lambda name, start, info: events.append((name, start, dict(info))))
    tr.train_step()
    names = [(n, s) for n, s, _ in events]
    assert names == [("generation", True), ("generation", False), ("logprobs", True), ("logprobs", False),
                     ("logprobs", True), ("logprobs", False), ("optimizer", True), ("optimizer", False)], names
    gen_end = events[1][2]
    # 4 prompts x 4 samples, each 1..5 tokens
    assert 16 <= gen_end["tokens"] <= 16 * 5
    # the optimizer phase holds the optimizer step: the weights change inside it, not outside
    before = {}

    def snap(name, start, info):
        if name == "optimizer":
            before[start] = [p.detach().clone() for p in tr.model.parameters()][:1][0]

    tr.phase_hooks[:] = [snap]
    tr.train_step()
    assert not torch.equal(before[True], before[False])
