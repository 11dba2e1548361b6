#!/usr/bin/env python
"""Where a policy loss's time goes: per-op CPU time of ``Method.loss`` forward + backward,
next to PPO-clip GRPO's, with torch.profiler (the batch of ``scripts/bench_losses.py``).

For each method the table lists every ATen op by self CPU time per step, GRPO's time for the
same op, and the difference, so the ops a method adds over GRPO (and what they cost) can be
read off directly. The profiler adds overhead per op (~5-20 us), so totals run a little above
``bench_losses.py``'s; compare the rows, not the totals, with it.

Usage::

    python scripts/profile_loss_ops.py rkl dph_js_def clip_cov
    python scripts/profile_loss_ops.py lad_js --steps 10 --top 25
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_losses import Batch, keep_freed_memory  # noqa: E402

from openrlhf_div.algorithms import get_method  # noqa: E402


def op_times(run, steps: int):
    """Self CPU time per ATen op per step (ms), and the step's total."""
    for _ in range(2):
        run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    per_op = defaultdict(float)
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            per_op[e.key[6:]] += e.self_cpu_time_total / 1e3 / steps
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / steps
    return per_op, total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("methods", nargs="+", help="registered method names (anchor methods: add +anchor)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5, help="profiled steps per method (default 5)")
    p.add_argument("--top", type=int, default=18, help="ops listed per method (default 18)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    batch = Batch(args.batch, args.seq, torch.device("cpu"))
    grpo = batch.runner(get_method("grpo"), False)
    op_times(grpo, 1)  # the first profiled steps also grow the heap (page faults): not counted
    base, base_total = op_times(grpo, args.steps)
    for spec in args.methods:
        name, _, extra = spec.partition("+")
        ops, total = op_times(batch.runner(get_method(name), extra == "anchor"), args.steps)
        print(f"\n{spec}: {total:.1f} ms per step (profiled; GRPO {base_total:.1f} ms), by op:")
        print(f"  {'op':28s} {spec[:10]:>10s} {'grpo':>8s} {'added':>8s}")
        rows = sorted(set(ops) | set(base), key=lambda k: -abs(ops.get(k, 0.0) - base.get(k, 0.0)))
        for k in rows[:args.top]:
            a, b = ops.get(k, 0.0), base.get(k, 0.0)
            print(f"  {k:28s} {a:10.2f} {b:8.2f} {a - b:+8.2f}")


if __name__ == "__main__":
    main()
