"""examples/scripts/run.sh, the one launcher of every Ray experiment (issue 24, item 5): it finds
an experiment by name, refuses a base or an unknown name with the list, and docs/configs.md holds
a copy-pasteable command for exactly the experiments there are. Bash only: about 1 s."""
from __future__ import annotations

import glob
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "examples", "scripts", "run.sh")


def _experiments():
    return sorted(os.path.basename(p)[:-5] for d in ("openrlhf", "megatron")
                  for p in glob.glob(os.path.join(ROOT, "configs", d, "[!_]*.yaml")))


def test_docs_list_one_command_per_experiment():
    text = open(os.path.join(ROOT, "docs", "configs.md")).read()
    listed = re.findall(r"^bash examples/scripts/run\.sh (\S+)$", text, flags=re.M)
    assert sorted(listed) == _experiments()
    # no per-config wrappers left beside it
    left = glob.glob(os.path.join(ROOT, "examples", "scripts", "**", "*.sh"), recursive=True)
    assert sorted(os.path.relpath(p, ROOT) for p in left) == [
        "examples/scripts/_common.sh", "examples/scripts/run.sh", "examples/scripts/sweep_methods.sh"]


def test_unknown_experiment_and_base_are_refused_with_the_list():
    # the one lookup (Python's find_experiment, called by the launcher): "did you mean" with the closest names
    for name, close in (("llama8b_bird_dph_jss", "llama8b_bird_dph_js"), ("_llama8b_bird", "llama8b_bird_grpo")):
        r = subprocess.run(["bash", RUN, name], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"no experiment '{name}'; did you mean" in r.stderr and close in r.stderr
    r = subprocess.run(["bash", RUN, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "run.sh EXPERIMENT [--submit]" in r.stdout
    assert subprocess.run(["bash", RUN], capture_output=True, text=True, timeout=60).returncode == 2
