"""Issue 42: the drivers' own settings the schema owns have one name: anchors per step are
``optim.anchor_batch_size`` (the Ray drivers'
``--div.anchor_batch_size`` is its rendering), honoured by the local engine too; and no shipped file
loads with an old-spelling note (the ``toy:`` overlays included, which ``config convert`` does not see).
"""
from __future__ import annotations

import glob
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _experiment(tmp_path, body: str, name: str = "exp.yaml") -> str:
    d = tmp_path / "configs"
    d.mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, "configs", "openrlhf", "_tiny_cpu.yaml"), d / "_tiny_cpu.yaml")
    (tmp_path / "toy").mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, "configs", "toy", "math.yaml"), tmp_path / "toy" / "math.yaml")
    p = d / name
    p.write_text("extends: _tiny_cpu.yaml\nexperiment: exp\nmethod: {name: dph_js}\n"
                 "div: {anchor_data: /tmp/none}\nopenrlhf: {train.batch_size: 20}\n" + body)
    return str(p)


def _with_div(tmp_path, body: str, div_extra: str, name: str) -> str:
    """:func:`_experiment` with more keys in its `div:` (an old spelling, a driver-only setting)."""
    p = _experiment(tmp_path, body, name=name)
    with open(p) as fh:
        text = fh.read().replace("div: {anchor_data: /tmp/none}", "div: {anchor_data: /tmp/none, " + div_extra + "}")
    with open(p, "w") as fh:
        fh.write(text)
    return p


def test_anchor_batch_size_reaches_the_ray_driver_and_the_local_engine(tmp_path, capsys):
    """Mutation: "optim.anchor_batch_size" removed from schema.DIV_FLAGS -> the Ray driver keeps None here."""
    from openrlhf_div import schema
    from openrlhf_div.config import load_experiment
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.local.config import config_from_dict
    from openrlhf_div.engines.openrlhf import launch
    from openrlhf_div.engines.provenance import settings_of

    p = _experiment(tmp_path, "optim: {anchor_batch_size: 4}\n")  # 8 prompts x 2 samples + 4 anchors = 20
    plan = launch.plan(["--config", p, "--dry-run"])
    assert plan.args.div.anchor_batch_size == 4
    data, _ = E.to_local(E.load(p), run_dir=str(tmp_path / "run"), toy=False)
    local = config_from_dict(data)
    assert settings_of(local)["anchor.per_step"] == 4 == settings_of(plan)["anchor.per_step"]
    schema._NOTED.clear()
    old = _with_div(tmp_path, "", "anchor_batch_size: 4", "old.yaml")
    assert load_experiment(old)["div"]["anchor_batch_size"] == 4
    assert "div.anchor_batch_size is spelt optim.anchor_batch_size" in capsys.readouterr().err


@pytest.mark.parametrize("size,mini,want", [(6, 4, [2, 2, 1, 1]), (4, 1, [4]), (0, 2, [0, 0]), (None, 2, [4, 4])])
def test_the_local_engine_splits_the_steps_anchors_over_its_mini_batches(size, mini, want):
    """``optim.anchor_batch_size`` anchors per rollout step, split over the mini-batches (they sum to it);
    unset: each mini-batch's rows / anchor_ratio, rounded up (32 online rows, ratio 4)."""
    from openrlhf_div.engines.local.config import config_from_dict
    from openrlhf_div.engines.provenance import settings_of

    cfg = config_from_dict({"task": "math", "method": {"name": "dph_js"},
                            "rollout": {"prompts_per_step": 8, "group_size": 4},
                            "optim": {"mini_batches": mini, "anchor_ratio": 4, "anchor_batch_size": size}})
    got = [cfg.anchors_per_mini_batch(32 // mini, i) for i in range(mini)]
    assert got == want
    assert settings_of(cfg)["anchor.per_step"] == sum(want)


def test_no_shipped_file_loads_with_an_old_spelling_note(capsys):
    """Every experiment under configs/ (with its toy overlay) loads without a "spelt ... now" note.
    Mutation: configs/toy/math.yaml back to `div: {anchor_batch_size: 2}` -> this fails."""
    from openrlhf_div import schema
    from openrlhf_div.engines import experiment as E

    schema._NOTED.clear()
    for p in sorted(glob.glob(os.path.join(ROOT, "configs", "*", "[!_]*.yaml"))):
        if os.path.basename(os.path.dirname(p)) != "toy":
            E.load(p)  # the file, its family base and the base's toy overlay, each rendered
    err = capsys.readouterr().err
    assert "now (the old spelling still loads" not in err, err[:2000]


def test_the_eval_top_p_has_one_name(tmp_path, capsys):
    """`eval.top_p` is the Ray drivers' --div.eval_top_p (the run's and the final evaluation's nucleus)
    and the local engine's eval.top_p; the old div.eval_top_p loads with one line.
    Mutation: "eval.top_p" removed from schema.DIV_FLAGS -> the Ray plan refuses it as local-only."""
    from openrlhf_div import schema
    from openrlhf_div.config import load_experiment
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.openrlhf import launch

    p = _experiment(tmp_path, "optim: {anchor_batch_size: 4}\neval: {top_p: 0.95}\n")
    assert launch.plan(["--config", p, "--dry-run"]).args.div.eval_top_p == 0.95
    data, _ = E.to_local(E.load(p), run_dir=str(tmp_path / "run"), toy=False)
    assert data["eval"]["top_p"] == 0.95
    schema._NOTED.clear()
    old = _with_div(tmp_path, "optim: {anchor_batch_size: 4}\n", "eval_top_p: 0.95", "old.yaml")
    assert load_experiment(old)["div"]["eval_top_p"] == 0.95
    assert "div.eval_top_p is spelt eval.top_p" in capsys.readouterr().err


def test_flowrls_log_z_learning_rate_has_one_name(tmp_path):
    """`optim.log_z_lr` is the drivers' --div.log_z_lr and the local engine's optim.log_z_lr (before: the
    local translation dropped a file's div.log_z_lr). Mutation: to_local's log_z_lr line removed -> fails."""
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.openrlhf import launch

    p = _experiment(tmp_path, "optim: {log_z_lr: 0.01, anchor_batch_size: 4}\n")
    assert launch.plan(["--config", p, "--dry-run"]).args.div.log_z_lr == 0.01
    data, _ = E.to_local(E.load(p), run_dir=str(tmp_path / "run"), toy=False)
    assert data["optim"]["log_z_lr"] == 0.01


def test_the_ray_drivers_own_settings_are_listed_and_refused_locally(tmp_path, capsys):
    """`config fields` lists the drivers' own div: settings (no local counterpart), and the local engine
    refuses each one by name instead of dropping it. Mutation: RAY_ONLY_DIV emptied -> fails."""
    from openrlhf_div.cli.main import main
    from openrlhf_div.engines import experiment as E

    assert main(["config", "fields", "--section", "div"]) == 0
    out = capsys.readouterr().out
    for key in ("anchor_seed", "truncate_prompts", "drop_long_prompts", "eval_greedy", "actor_backend"):
        assert f"div.{key}:" in out
    p = _with_div(tmp_path, "optim: {anchor_batch_size: 4}\n", "eval_greedy: true", "greedy.yaml")
    refusals = E.local_refusals(E.load(p), toy=False)
    assert any(r.startswith("div.eval_greedy=True: the local engine's evaluation samples only") for r in refusals)
