"""`openrlhf-div run EXPERIMENT --engine local --toy`: a paper experiment's own method, estimator,
rollout and optimiser settings on the local engine in seconds (the family base's `toy:` overlay).

CI runs a subset that covers every kind of experiment (math with D_pef anchors, DAPO's dynamic
sampling and overlong shaping, LAD with its clip, the SQL family under the authors' aggregation);
``OPENRLHF_DIV_TOY_ALL=1`` walks every experiment under configs/ (anchor methods on the SQL
families are refused by name: a tiny random model writes no correct SQL, so pre-sampling finds no
D_pef). Measured on the shared 2-core machine, one process: the 43 experiments in 42 s (1-12 s each;
21 of them, the anchor methods of the SQL families, refused by name), the CI subset in about 10 s.
"""
from __future__ import annotations

import glob
import json
import os

import pytest
import yaml

from openrlhf_div.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBSET = ["tiny_cpu_dph_js", "qwen25math7b_dapo17k_dapo", "qwen25_7b_dapomath_lad_js", "llama8b_bird_grpo"]
ALL = sorted(os.path.basename(p)[:-5] for sub in ("openrlhf", "megatron")
             for p in glob.glob(os.path.join(ROOT, "configs", sub, "[!_]*.yaml")))
SQL_ANCHOR = "trains on D_pef anchors, and the tiny random model of the SQL toy"

pytestmark = pytest.mark.slow


def _run(name, run_dir, *extra):
    return main(["run", name, "--engine", "local", "--toy", "--run-dir", str(run_dir), *extra])


def _steps(run_dir):
    return [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.mark.parametrize("name", ALL if os.environ.get("OPENRLHF_DIV_TOY_ALL") else SUBSET)
def test_toy_run_on_the_local_engine(name, tmp_path, capsys):
    from openrlhf_div.algorithms import get_method
    from openrlhf_div.engines import experiment as E

    rc = _run(name, tmp_path / "run")
    err = capsys.readouterr().err
    if rc == 2 and SQL_ANCHOR in err:  # refused by name, before anything started
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
        return
    assert rc == 0, err[-3000:]
    assert [r["step"] for r in _steps(tmp_path / "run")] == [1, 2]
    # the run's method is the experiment's, with the hyperparameters it sets
    cfg = yaml.safe_load(open(tmp_path / "run" / "config.yaml"))
    want = E.method_section(E.load(E.find_experiment(name)))
    assert cfg["method"] == want
    m = get_method(want["name"], **{k: v for k, v in want.items() if k != "name"})
    assert m.name == want["name"]


def test_method_anchor_eta_travels_from_the_command_line_to_the_loss(tmp_path, capsys):
    """`method.anchor_eta=0.3` on `run`: one override spelling, the experiment's method section,
    the TrainConfig, Method.with_overrides, the loss: every step's L = L_exp + 0.3 L_pef."""
    run = tmp_path / "run"
    assert _run("tiny_cpu_dph_js", run, "method.anchor_eta=0.3", "local.optim.steps=3") == 0, capsys.readouterr().err
    rows = _steps(run)
    assert len(rows) == 3 and any(r["loss_pef"] != 0 for r in rows), rows
    for r in rows:
        assert r["loss"] == pytest.approx(r["loss_exp"] + 0.3 * r["loss_pef"], rel=1e-5, abs=1e-7)
    assert yaml.safe_load(open(run / "config.yaml"))["method"]["anchor_eta"] == 0.3


def test_what_an_engine_cannot_honour_is_refused_by_name(tmp_path, capsys):
    # the authors' layout (layout:) of the Llama-SQL configs, on the local engine without --toy
    assert main(["run", "llama8b_bird_dph_js", "--engine", "local", "--run-dir", str(tmp_path / "a")]) == 2
    assert "layout.step_layout=authors" in capsys.readouterr().err
    assert _run("llama8b_bird_dph_js", tmp_path / "b") == 2
    assert SQL_ANCHOR in capsys.readouterr().err
    assert _run("tiny_cpu_grpo", tmp_path / "c", "--", "--ckpt.load_enable") == 2
    assert "--ckpt.load_enable: an OpenRLHF flag" in capsys.readouterr().err
    # --toy on the Ray engines: refused in one line that says why and what to run instead
    assert main(["run", "tiny_cpu_grpo", "--engine", "openrlhf", "--toy"]) == 2
    assert "tiny_cpu_grpo already is the Ray engines' toy" in capsys.readouterr().err
    assert main(["run", "llama8b_bird_rkl", "--engine", "megatron", "--toy"]) == 2
    err = capsys.readouterr().err
    assert "the toy overlay is the local engine's" in err and "openrlhf-div run llama8b_bird_rkl --engine local --toy" in err
    assert "openrlhf-div run tiny_cpu_rkl --engine megatron" in err
    assert main(["run", "tiny_cpu_grpp", "--engine", "local"]) == 2
    assert "did you mean tiny_cpu_grpo" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "abc")


def test_overrides_mean_the_same_on_the_ray_engines(monkeypatch):
    """`section.key=value` overrides on the Ray driver's command line are merged into the experiment
    by the one loader, as on the local engine (OpenRLHF's dotted flags included)."""
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.openrlhf import launch as L

    for var in ("DATA_DIR", "RUN_DIR", "PRESAMPLE_DIR", "SEED", "TINY_MODEL"):
        monkeypatch.delenv(var, raising=False)
    path = E.find_experiment("tiny_cpu_dph_js")
    p = L.plan(["--config", path, "method.anchor_eta=0.3", "seed=7", "--dry-run"])
    assert p.method.hparams["anchor_eta"] == 0.3 and p.args.train.seed == 7
    # the printed command shows the experiment rendered, the override included
    assert "--div.anchor_eta 0.3" in p.command and "--train.seed 7" in p.command
    assert "hyperparameters set: anchor_eta=0.3" in p.summary()  # the preset's summary says eta 0.2
    # a --div.<key> flag on the command line wins over the file and its overrides
    p = L.plan(["--config", path, "method.anchor_eta=0.3", "--div.anchor_eta", "0.5", "--dry-run"])
    assert p.method.hparams["anchor_eta"] == 0.5
    with pytest.raises(ValueError, match="no hyperparameter 'anchr'"):  # a typo is refused in one line, not dropped
        L.plan(["--config", path, "method.anchr=0.3", "--dry-run"])


def test_a_hyperparameter_is_converted_once_and_the_same_on_every_engine(tmp_path, monkeypatch):
    """`method.anchor_eta=V` from the command line: the local engine's method and what the Ray
    trainer builds (method_from_args on the driver's namespace, as the policy actor and the
    Megatron actor do) hold the same Python value; the driver's namespace holds the value the
    one loader read (not a text rendering parsed again by argparse), converted once by the
    registry's coerce_hparam. `1e-3` is the case where two loaders disagreed (PyYAML alone reads a
    string; the one loader reads a float)."""
    from openrlhf_div.algorithms.registry import coerce_hparam
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.flags import method_from_args
    from openrlhf_div.engines.local.config import config_from_dict
    from openrlhf_div.engines.megatron.actor import resolve_method
    from openrlhf_div.engines.openrlhf import launch as L

    for var in ("DATA_DIR", "RUN_DIR", "PRESAMPLE_DIR", "SEED", "TINY_MODEL"):
        monkeypatch.delenv(var, raising=False)
    path = E.find_experiment("tiny_cpu_dph_js")
    for text, want in (("0.3", 0.3), ("1e-3", 0.001), ("1", 1.0)):
        over = [f"method.anchor_eta={text}"]
        local_cfg, _ = E.to_local(E.load(path, over, toy=True), run_dir=str(tmp_path), toy=True)
        local = config_from_dict(local_cfg).build_method().hparams["anchor_eta"]
        p = L.plan(["--config", path, *over, "--dry-run"])
        ray = method_from_args(p.args).hparams["anchor_eta"]
        mg = resolve_method(L.plan(["--config", path, *over, "--div.actor_backend", "megatron", "--dry-run"]).args)
        for v in (local, ray, p.method.hparams["anchor_eta"], mg.hparams["anchor_eta"]):
            assert type(v) is float and v == want, (text, v)
        # the namespace holds what the loader read; the method converted it
        assert p.args.div.anchor_eta == E.load(path, over)["method"]["anchor_eta"]
    # the one coercion, also the --div.* flags' argparse type
    assert coerce_hparam("anchor_eta", "1e-3") == 0.001 and coerce_hparam("dual_clip", "none") is None
    assert coerce_hparam("micro_batch_seqs", 2.0) == 2 and coerce_hparam("lad_clip", [0.2, "0.28"]) == (0.2, 0.28)
    with pytest.raises(ValueError, match="anchor_eta: expected a number"):
        coerce_hparam("anchor_eta", "abc")
    p = L.plan(["--config", path, "--div.anchor_eta", "1e-3", "--dry-run"])
    assert p.method.hparams["anchor_eta"] == 0.001


def test_one_experiment_resolves_to_one_method_on_every_engine(tmp_path, monkeypatch):
    """tiny_cpu_dph_js with `method.anchor_eta=0.3`: the local engine's TrainConfig, the OpenRLHF
    driver's plan (what its policy actor builds from the flags) and the Megatron actor's
    resolve_method give the same method, aggregation and hyperparameters, and the same layout."""
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.layout import EngineLayout
    from openrlhf_div.engines.local.config import config_from_dict
    from openrlhf_div.engines.megatron.actor import resolve_method
    from openrlhf_div.engines.openrlhf import launch as L

    for var in ("DATA_DIR", "RUN_DIR", "PRESAMPLE_DIR", "SEED", "TINY_MODEL"):
        monkeypatch.delenv(var, raising=False)
    path = E.find_experiment("tiny_cpu_dph_js")
    over = ["method.anchor_eta=0.3"]
    local_cfg, _ = E.to_local(E.load(path, over, toy=True), run_dir=str(tmp_path), toy=True)
    local = config_from_dict(local_cfg).build_method()
    ray = L.plan(["--config", path, *over, "--dry-run"])
    mg = L.plan(["--config", path, *over, "--div.actor_backend", "megatron", "--dry-run"])
    megatron = resolve_method(mg.args)
    for m in (ray.method, megatron):
        assert (m.name, m.aggregation, m.dynamic_sampling, m.hparams) == \
            (local.name, local.aggregation, local.dynamic_sampling, local.hparams)
    assert local.hparams["anchor_eta"] == 0.3
    assert EngineLayout.from_args(ray.args) == EngineLayout.from_args(mg.args) == EngineLayout()


def test_ray_engines_get_the_overrides_as_driver_flags(capfd, monkeypatch):
    """`run EXPERIMENT --engine megatron method.anchor_eta=0.3 -- FLAGS` goes through the one Ray
    launcher, the override as written (the driver merges it with the one loader) (examples/scripts/run.sh; DRY_RUN=1 prints its commands instead of running them)."""
    monkeypatch.setenv("DRY_RUN", "1")
    assert main(["run", "tiny_cpu_dph_js", "--engine", "megatron", "method.anchor_eta=0.3", "--",
                 "--train.num_episodes", "2"]) == 0
    out = capfd.readouterr()
    train = [line for line in (out.out + out.err).splitlines() if "openrlhf_div.cli.train_ppo_ray" in line][-1]
    assert train.rstrip().endswith("tiny_cpu_dph_js.yaml method.anchor_eta=0.3 --train.num_episodes 2 --div.actor_backend megatron")
    # the pre-sampling stage merges the same overrides into the experiment
    pre = [line for line in (out.out + out.err).splitlines() if "openrlhf_div.cli.presample_ray" in line][-1]
    assert "method.anchor_eta=0.3" in pre
