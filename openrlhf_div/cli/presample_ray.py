"""``python -m openrlhf_div.cli.presample_ray``: DPH-RL's pre-sampling stage at scale.

vLLM engines sample ``n_pre`` responses per training prompt (scored by the task's reward
function), OpenRLHF's DeepSpeed actor forward computes the base log-probs of the kept correct
responses, and the split is written in resumable shards (``d_pef.jsonl`` / ``d_exp.jsonl``, the
local engine's layout). Takes OpenRLHF's model / data / rollout / vLLM flags, ``--div.task``
and ``--presample.*``; ``--config`` reads a config's ``openrlhf:`` and ``presample:`` sections.
See :mod:`openrlhf_div.engines.openrlhf.presample`.
"""
from __future__ import annotations

import sys

from openrlhf_div.engines.openrlhf.presample import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
