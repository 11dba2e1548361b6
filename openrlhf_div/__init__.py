"""openrlhf-div: diversity-preserving reinforcement learning with verifiable rewards.

The pure-torch algorithm library lives in :mod:`openrlhf_div.algorithms`; evaluation
metrics in :mod:`openrlhf_div.eval`; the command line in :mod:`openrlhf_div.cli`.
"""

__version__ = "0.1.0"
