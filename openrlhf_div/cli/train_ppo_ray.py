"""``python -m openrlhf_div.cli.train_ppo_ray``: every method on OpenRLHF 0.11.2's Ray topology.

Accepts every flag of OpenRLHF's ``openrlhf.cli.train_ppo_ray`` plus the ``--div.*`` group
(method, its hyperparameters, ``--div.anchor_data`` for DPH's ``D_pef``, ...), an optional
``--config configs/openrlhf/<experiment>.yaml`` and ``--dry-run`` (print the final command and
the topology, no Ray). See :mod:`openrlhf_div.engines.openrlhf.launch` and docs/scaling.md.
"""
from __future__ import annotations

import sys

from openrlhf_div.engines.openrlhf.launch import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
