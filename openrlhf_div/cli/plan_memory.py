"""``openrlhf-div plan-memory``: the Megatron actor's memory plan on paper
(:mod:`openrlhf_div.engines.megatron.memory_plan`)."""
from __future__ import annotations


def add_parser(sub):
    from openrlhf_div.engines.megatron.memory_plan import PLAN_HELP, add_arguments

    p = sub.add_parser("plan-memory", help=PLAN_HELP, description=PLAN_HELP + ": per GPU and per node, in the "
                       "three phases of a colocated step (docs/scaling_megatron.md)")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from openrlhf_div.engines.megatron.memory_plan import run as plan

    return plan(args)
