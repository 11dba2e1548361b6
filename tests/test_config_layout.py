"""configs/ holds no copies: no two files differ only in their method lines, and no two
experiments (files with an ``experiment:``) repeat most of each other's settings (shared
settings belong in a family base that both extend; family bases of different models and data
may share OpenRLHF defaults). Method lines are the settings that name or tune the method and the experiment:
``experiment``, the ``div:`` section (but ``task`` and ``actor_backend``) and every key
starting with ``method`` (``method``, ``methods``, ``method_settings``, ``method_notes``)."""
import glob
import itertools
import os

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_METHOD_IN_DIV = {"task", "actor_backend"}


def settings(data):
    """Flattened ``{(section, key): value}`` of one file as written (no extends resolved)."""
    out = {}
    for k, v in (data or {}).items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                out[(k, k2)] = repr(v2)
        else:
            out[(k,)] = repr(v)
    return out


def is_method(key):
    if key[0] == "experiment" or any(str(part).startswith("method") for part in key):
        return True
    return key[0] == "div" and len(key) > 1 and key[1] not in NOT_METHOD_IN_DIV


def copies(files):
    """``[(a, b, why)]`` for every pair of files that are copies of each other."""
    body = {f: {k: v for k, v in settings(d).items() if k != ("extends",) and not is_method(k)}
            for f, d in files.items()}
    bad = []
    for a, b in itertools.combinations(sorted(files), 2):
        A, B = body[a], body[b]
        if A and A == B:
            bad.append((a, b, "differ only in method lines"))
            continue
        if not ("experiment" in (files[a] or {}) and "experiment" in (files[b] or {})):
            continue
        shared = {k for k in A.keys() & B.keys() if A[k] == B[k]}
        if len(shared) >= 3 and 2 * len(shared) >= min(len(A), len(B)):
            bad.append((a, b, f"{len(shared)} of their {len(A)} / {len(B)} settings are the same: "
                              f"move them into a base both extend"))
    return bad


def _tree():
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))
    assert len(paths) > 30
    return {os.path.relpath(p, ROOT): yaml.safe_load(open(p)) for p in paths}


def test_configs_has_no_two_files_that_differ_only_in_method_lines():
    bad = copies(_tree())
    assert not bad, "\n".join(f"{a} / {b}: {why}" for a, b, why in bad)


def test_the_check_sees_copies():
    """The pre-#15 layout (a full file per method) and a copy that only changes a method
    hyperparameter are caught; a family base with small per-method files is not."""
    full = {"experiment": "x", "div": {"method": "grpo", "task": "math"},
            "openrlhf": {f"k{i}": i for i in range(20)}, "cluster": {"nodes": 1}}
    rkl = {**full, "experiment": "y", "div": {"method": "rkl", "task": "math", "kl_coef": 0.1}}
    assert copies({"a.yaml": full, "b.yaml": rkl}) == [("a.yaml", "b.yaml", "differ only in method lines")]
    bigger = {**rkl, "openrlhf": {**full["openrlhf"], "ref.num_nodes": 1, "train.batch_size": 20}}
    assert copies({"a.yaml": full, "b.yaml": bigger})[0][2].startswith("22 of their 22 / 24 settings")
    base = {"div": {"task": "math"}, "openrlhf": full["openrlhf"], "cluster": {"nodes": 1}}
    one = {"extends": "_base.yaml", "experiment": "x_grpo", "div": {"method": "grpo"}}
    two = {"extends": "_base.yaml", "experiment": "x_rkl", "div": {"method": "rkl", "kl_coef": 0.1},
           "openrlhf": {"ref.num_nodes": 1}}
    assert copies({"_base.yaml": base, "x_grpo.yaml": one, "x_rkl.yaml": two}) == []
