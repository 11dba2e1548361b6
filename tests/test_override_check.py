"""Issue 43 item 1: a typo in a ``section.key=value`` override is refused in one line, with "did
you mean", before anything starts -- the same line on the local engine, the Ray drivers and the
Ray launcher (examples/scripts/run.sh), which checks before it starts a Ray head or submits a job."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = os.path.join(ROOT, "configs", "openrlhf", "tiny_cpu_dph_js.yaml")

TYPOS = [
    ("method.anchr_eta=1", "config section `method`: method 'dph_js' has no hyperparameter 'anchr_eta'. "
                           "Did you mean 'anchor_eta'"),
    ("method.name=grpoo", "config section `method`: unknown method 'grpoo'. Did you mean 'grpo'"),
    ("layout.step_layot=authors", "unknown config key 'layout.step_layot'. Did you mean 'layout.step_layout'"),
    ("openrlhf.train.batchsize=4", "unknown key 'openrlhf.train.batchsize'. Did you mean 'openrlhf.train.batch_size'"),
    ("div.anchr_ratio=4", "unknown key 'div.anchr_ratio'. Did you mean 'div.anchor_ratio'"),
    ("presample.n_pree=4", "unknown key 'presample.n_pree'. Did you mean 'presample.n_pre'"),
    ("methd.anchor_eta=1", "unknown config section 'methd'. Did you mean 'method'"),
    ("task=mathh", "unknown task 'mathh'. Did you mean 'math'"),
]


@pytest.mark.parametrize("override,line", TYPOS, ids=[t[0] for t in TYPOS])
def test_the_one_loader_refuses_a_typo_naming_the_closest_key(override, line):
    from openrlhf_div.config import ConfigError
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.openrlhf import presample  # noqa: F401 - registers the Ray driver's flags, as every
    # process that reads openrlhf:/div:/presample: overrides does (openrlhf-div run, the drivers, run.sh's check)

    with pytest.raises(ConfigError) as err:
        E.load(CFG, [override])
    assert line in str(err.value) and "\n" not in str(err.value)


def test_valid_overrides_pass():
    from openrlhf_div.engines import experiment as E

    cfg = E.load(CFG, ["method.anchor_eta=0.3", "layout.step_layout=authors", "openrlhf.train.batch_size=4",
                       "presample.n_pre=4", "presample.vllm.num_engines=1", "div.anchor_ratio=4", "task=math",
                       "local.data.presample_dir=/tmp/x"])
    assert cfg["method"]["anchor_eta"] == 0.3 and cfg["openrlhf"]["train.batch_size"] == 4


def _err_lines(text: str):
    return [ln for ln in text.splitlines() if ln.strip()]


def test_the_same_line_from_the_local_engine_and_both_ray_drivers(capsys):
    """`openrlhf-div run --engine local`, the training driver and the pre-sampling driver: one
    line each, the same refusal (no usage block)."""
    from openrlhf_div.cli.main import main as cli
    from openrlhf_div.engines.openrlhf import launch as L
    from openrlhf_div.engines.openrlhf import presample as P

    want = "method 'dph_js' has no hyperparameter 'anchr_eta'. Did you mean 'anchor_eta'"
    for call in (lambda: cli(["run", "tiny_cpu_dph_js", "--engine", "local", "--dry-run", "method.anchr_eta=1"]),
                 lambda: L.main(["--config", CFG, "method.anchr_eta=1", "--dry-run"]),
                 lambda: P.main(["--config", CFG, "method.anchr_eta=1", "--dry-run"])):
        try:
            rc = call()
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2, err
        lines = _err_lines(err)
        assert len(lines) == 1 and want in lines[0], err


def test_a_flag_typo_on_the_ray_driver_is_one_line_not_the_usage(capsys):
    from openrlhf_div.engines.openrlhf import launch as L

    with pytest.raises(SystemExit) as e:
        L.main(["--config", CFG, "--div.anchr_eta", "1", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert _err_lines(err) == [ln for ln in _err_lines(err) if "unrecognized arguments: --div.anchr_eta 1" in ln]
    assert "Did you mean --div.anchor_eta" in err


@pytest.mark.parametrize("submit", [False, True], ids=["run", "submit"])
def test_the_ray_launcher_refuses_before_anything_starts(submit, tmp_path):
    """run.sh [--submit] with a typo: one line, exit 2, before the pre-sampling stage or a Ray head
    (DRY_RUN=1: nothing would start even if the check were missing; then the launcher would go on
    and print the stages)."""
    env = dict(os.environ, DRY_RUN="1", RUN_DIR=str(tmp_path / "run"), PYTHON=sys.executable)
    cmd = ["bash", os.path.join(ROOT, "examples", "scripts", "run.sh"), "tiny_cpu_dph_js"]
    cmd += (["--submit"] if submit else []) + ["method.name=grpoo"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "" and len(_err_lines(r.stderr)) == 1, r.stderr
    assert "unknown method 'grpoo'. Did you mean 'grpo'" in r.stderr


def test_an_invalid_choice_on_the_ray_driver_is_one_line_with_the_closest(capsys):
    from openrlhf_div.engines.openrlhf import launch as L

    with pytest.raises(SystemExit) as e:
        L.main(["--config", CFG, "--div.method", "grpoo", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(_err_lines(err)) == 1, err
    assert "invalid choice: 'grpoo'" in err and "Did you mean grpo" in err
