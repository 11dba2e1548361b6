"""Every experiment in configs/ resolves to exactly what it resolved to before the configs were
split into family bases and per-method files (tests/fixtures/configs_resolved.json, written by
the loaders and the config files of that time): the resolved mapping, the driver's final
flags (config + method-implied flags, validated by OpenRLHF's own checks), the GPU count, the
pre-sampling stage's flags, the demo settings and the local engine's TrainConfig, with the
``${VAR}`` variables unset and set. scripts/resolve_configs.py computes it."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOT = os.path.join(ROOT, "tests", "fixtures", "configs_resolved.json")


def _resolver():
    spec = importlib.util.spec_from_file_location("resolve_configs", os.path.join(ROOT, "scripts", "resolve_configs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_experiment_resolves_as_in_the_snapshot():
    R = _resolver()
    with open(SNAPSHOT) as fh:
        old = json.load(fh)
    new = R.resolve_all()
    assert set(new) == set(old), f"experiments added/removed: {sorted(set(new) ^ set(old))}"
    diff = R.differences(old, new)
    assert not diff, "\n".join(diff[:40])


def test_the_comparison_sees_a_changed_value():
    R = _resolver()
    with open(SNAPSHOT) as fh:
        old = json.load(fh)
    new = json.loads(json.dumps(old))
    flags = new["configs/openrlhf/tiny_cpu_grpo.yaml"]["set"]["train_flags"]
    flags["--train.batch_size"] = [["32"]]
    assert R.differences(old, new) == [
        '/configs/openrlhf/tiny_cpu_grpo.yaml/set/train_flags/--train.batch_size: [["16"]] -> [["32"]]']
    assert R.flag_map(["--a", "1", "--b", "--c", "x", "y"]) == R.flag_map(["--c", "x", "y", "--a", "1", "--b"])
    assert R.flag_map(["--a", "1"]) != R.flag_map(["--a", "2"])
