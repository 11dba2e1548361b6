"""Resolve every experiment config in ``configs/`` to what its launcher would run.

    python tests/tools/resolve_configs.py                      # JSON of every config, to stdout
    python tests/tools/resolve_configs.py --out FILE           # ... into FILE
    python tests/tools/resolve_configs.py --check FILE         # exit 1 and list the differences

For each config the output holds, under two fixed environments (the variables unset, so the
``${VAR:-default}`` defaults apply, and set to fixed absolute paths as the end-to-end tests do):

* ``configs/openrlhf/*.yaml``, ``configs/megatron/*.yaml``: the resolved mapping (every
  ``${VAR}`` expanded), the driver's final command line as flag -> values (``train_ppo_ray --dry-run``: config +
  method-implied flags, validated by OpenRLHF's own checks), the GPU count, and the
  pre-sampling stage's command line when the config has one;
* ``configs/demo*.yaml``: the demo settings, normal and ``--quick``;
* ``configs/local_example.yaml``: the local engine's validated TrainConfig.

Use it around a restructuring of the configs: ``--out before.json`` first, ``--check before.json``
after, and every resolved value that moved is listed. (The tests pin only what a reviewer must
see change: tests/test_experiments.py.)
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
from typing import Any, Dict, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

#: the variables the configs expand (``${VAR:-default}``) and the values of the "set" scenario
VARIABLES = {"TINY_MODEL": "/fixed/tiny_model", "DATA_DIR": "/fixed/data", "RUN_DIR": "/fixed/run",
             "PRESAMPLE_DIR": "/fixed/presample", "SEED": "7"}
SCENARIOS = {"defaults": {}, "set": VARIABLES}


@contextlib.contextmanager
def environment(values: Dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in VARIABLES}
    try:
        for k in VARIABLES:
            os.environ.pop(k, None)
        os.environ.update(values)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _expanded(node: Any) -> Any:
    from openrlhf_div.engines.openrlhf.launch import expand_env

    if isinstance(node, dict):
        return {str(k): _expanded(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_expanded(v) for v in node]
    if isinstance(node, str):
        return expand_env(node)
    return node


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _normalised(node: Any) -> Any:
    """JSON round trip with the repository root replaced (the snapshot holds no machine path)."""
    text = json.dumps(node, sort_keys=True, default=str)
    return json.loads(text.replace(ROOT, "<ROOT>"))


def flag_map(argv) -> Dict[str, list]:
    """A command line as ``{flag: [values of each occurrence]}``: the same flags and values in
    another order compare equal (argparse does not care), a changed or missing value does not."""
    out: Dict[str, list] = {}
    flag = None
    for tok in argv:
        if tok.startswith("--"):
            flag = tok
            out.setdefault(flag, []).append([])
        elif flag is None:
            raise ValueError(f"value {tok!r} before any flag in {argv}")
        else:
            out[flag][-1].append(tok)
    return out


def resolve_openrlhf(path: str) -> Dict[str, Any]:
    from openrlhf_div.engines.openrlhf import launch
    from openrlhf_div.engines.openrlhf.presample import presample_argv

    cfg = launch.load_config(path)
    p = launch.plan(["--config", path, "--dry-run"])
    out = {"config": _expanded(cfg), "train_flags": flag_map(p.argv), "gpus": dict(p.gpus),
           "cluster_gpus": p.cluster_gpus}
    if "presample" in cfg:
        out["presample_flags"] = flag_map(launch.config_argv(cfg) + presample_argv(cfg))
    out["local"] = resolve_local_translation(path)
    return out


def resolve_local_translation(path: str) -> Dict[str, Any]:
    """The experiment on the local engine (``run --engine local``'s translation, real data and
    ``--toy``): the TrainConfig mapping, or the one-line refusal."""
    from openrlhf_div.config import ConfigError
    from openrlhf_div.engines import experiment as E

    out: Dict[str, Any] = {}
    for toy in (False, True):
        try:
            cfg = E.load(path, toy=toy)
            data, _notes = E.to_local(cfg, run_dir="/fixed/local_run", toy=toy)
            out["toy" if toy else "real"] = data
        except ConfigError as e:
            out["toy" if toy else "real"] = {"refused": str(e)}
    return out


def resolve_demo(path: str) -> Dict[str, Any]:
    from openrlhf_div.demo.pipeline import load_demo_config

    return {"normal": load_demo_config(path), "quick": load_demo_config(path, quick=True)}


def resolve_local(path: str) -> Dict[str, Any]:
    from openrlhf_div.engines.local.config import load_config

    return {"train_config": load_config(path).to_dict()}


def experiments() -> Dict[str, Any]:
    """``{relative path: resolver}`` of every experiment config (family bases are not experiments)."""
    out = {}
    for sub in ("openrlhf", "megatron"):
        for p in sorted(glob.glob(os.path.join(ROOT, "configs", sub, "*.yaml"))):
            if not os.path.basename(p).startswith("_"):
                out[_rel(p)] = resolve_openrlhf
    for p in sorted(glob.glob(os.path.join(ROOT, "configs", "demo*.yaml"))):
        out[_rel(p)] = resolve_demo
    out[_rel(os.path.join(ROOT, "configs", "local_example.yaml"))] = resolve_local
    return out


def resolve_all() -> Dict[str, Any]:
    result: Dict[str, Any] = {}
    for rel, fn in experiments().items():
        result[rel] = {}
        for name, env in SCENARIOS.items():
            with environment(env):
                result[rel][name] = _normalised(fn(os.path.join(ROOT, rel)))
    return result


def differences(old: Any, new: Any, where: str = "") -> list:
    """Human-readable list of the paths at which two resolved trees differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            w = f"{where}/{k}"
            if k not in old:
                out.append(f"{w}: added {json.dumps(new[k])[:200]}")
            elif k not in new:
                out.append(f"{w}: removed (was {json.dumps(old[k])[:200]})")
            else:
                out += differences(old[k], new[k], w)
        return out
    if old != new:
        return [f"{where}: {json.dumps(old)[:300]} -> {json.dumps(new)[:300]}"]
    return []


def _without(node: Any, keys) -> Any:
    if isinstance(node, dict):
        return {k: _without(v, keys) for k, v in node.items() if k not in keys}
    return node


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    ap.add_argument("--check", metavar="SNAPSHOT", help="compare with a snapshot; exit 1 on any difference")
    ap.add_argument("--ignore", action="append", default=[], metavar="KEY",
                    help="leave this key out of the comparison wherever it occurs (e.g. `config`: the resolved "
                         "file, when a restructuring moves keys but must keep every command line and translation)")
    a = ap.parse_args(argv)
    resolved = resolve_all()
    if a.check:
        with open(a.check) as fh:
            diff = differences(_without(json.load(fh), a.ignore), _without(resolved, a.ignore))
        for line in diff:
            print(line)
        print(f"{len(resolved)} configs resolved; {len(diff)} difference(s) from {a.check}")
        return 1 if diff else 0
    text = json.dumps(resolved, indent=1, sort_keys=True) + "\n"
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
