"""The one schema (issue 42 items 1-2): one name per setting on every engine, help on every field,
the generated reference page, old spellings still loading with one line, the converter.

Mutations run when this was written (each made tests here fail, then was put back):
* ``OPENRLHF_FLAGS`` without ``rollout.group_size``: 7 fail (the reference page, the fields command,
  the Ray flag of a neutral setting and of an override, the old-spelling note, the converter);
* one word changed in docs/config_reference.md: test_reference_page_is_generated;
* ``render_file`` not noting old spellings: test_old_spelling_loads_with_one_line.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "openrlhf", "_tiny_cpu.yaml")


def _experiment(tmp_path, body: str, name: str = "exp_schema.yaml", method: str = "grpo") -> str:
    """An experiment over the tiny CPU family (copied next to it so `extends:` resolves)."""
    d = tmp_path / "configs"
    d.mkdir(exist_ok=True)
    for f in ("_tiny_cpu.yaml",):
        shutil.copy(TINY, d / f)
    toy = tmp_path / "toy"
    toy.mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, "configs", "toy", "math.yaml"), toy / "math.yaml")
    p = d / name
    p.write_text(f"extends: _tiny_cpu.yaml\nexperiment: exp_schema\nmethod: {{name: {method}}}\n" + body)
    return str(p)


def _ray_plan(path, *over):
    from openrlhf_div.engines.openrlhf import launch

    return launch.plan(["--config", path, *over, "--dry-run"])


def _local(path, *over):
    from openrlhf_div.engines import experiment as E

    cfg = E.load(path, list(over))
    out, _ = E.to_local(cfg, run_dir="/tmp/x", toy=False)
    return cfg, out


def test_every_field_has_help_type_and_engines():
    from openrlhf_div.engines.local.config import fields
    from openrlhf_div.schema import OPENRLHF_FLAGS

    rows = fields()
    keys = [f.key for f in rows]
    assert len(keys) == len(set(keys)) and len(rows) > 80
    for f in rows:
        assert f.help.strip() and f.type and f.engines and "local" in f.engines, f
    # every rendered name is a field of the schema, with the flag shown
    by_key = {f.key: f for f in rows}
    for key, flag in OPENRLHF_FLAGS.items():
        assert by_key[key].openrlhf == flag and "openrlhf" in by_key[key].engines
    assert by_key["optim.anchor_ratio"].openrlhf == "div.anchor_ratio"


def test_reference_page_is_generated():
    """docs/config_reference.md is `openrlhf-div config fields --markdown` (regenerate it with that command)."""
    from openrlhf_div.cli.config import reference_markdown

    with open(os.path.join(ROOT, "docs", "config_reference.md")) as fh:
        page = fh.read()
    assert page == reference_markdown(), ("docs/config_reference.md drifted from the schema: run "
                                       "`openrlhf-div config fields --markdown > docs/config_reference.md`")


def test_fields_command_prints_a_section(capsys):
    from openrlhf_div.cli.main import main

    assert main(["config", "fields", "--section", "rollout"]) == 0
    out = capsys.readouterr().out
    assert "rollout.group_size: int = 8" in out and "Ray driver --rollout.n_samples_per_prompt" in out
    assert "rollout.decode_step" in out and "(local)" in out


def test_neutral_setting_reaches_every_engine(tmp_path):
    """`rollout.group_size: 3` in the file: the Ray driver's flag and the local engine's setting."""
    p = _experiment(tmp_path, "rollout: {group_size: 3}\noptim: {learning_rate: 3e-4}\nseed: 11\n")
    plan = _ray_plan(p)
    assert plan.args.rollout.n_samples_per_prompt == 3 and plan.args.train.seed == 11
    assert abs(plan.args.actor.adam.lr - 3e-4) < 1e-12
    _, local = _local(p)
    assert local["rollout"]["group_size"] == 3 and local["seed"] == 11
    assert abs(local["optim"]["learning_rate"] - 3e-4) < 1e-12


def test_override_in_our_names(tmp_path):
    p = _experiment(tmp_path, "")
    plan = _ray_plan(p, "rollout.group_size=2", "seed=5")
    assert plan.args.rollout.n_samples_per_prompt == 2 and plan.args.train.seed == 5
    _, local = _local(p, "rollout.group_size=2", "seed=5")
    assert local["rollout"]["group_size"] == 2 and local["seed"] == 5
    from openrlhf_div.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.group_size"):  # a typo: did you mean
        _local(p, "rollout.group_sze=2")
    with pytest.raises(ConfigError, match="rollout.group_size.*expects int"):  # the type
        _local(p, "rollout.group_size=two")


def test_local_only_setting_refused_on_ray(tmp_path):
    p = _experiment(tmp_path, "rollout: {decode_step: static}\n")
    _, local = _local(p)
    assert local["rollout"]["decode_step"] == "static"
    with pytest.raises(ValueError, match="rollout.decode_step: honoured by the local engine only"):
        _ray_plan(p)


def test_old_spelling_loads_with_one_line(tmp_path, capsys):
    from openrlhf_div import schema
    from openrlhf_div.config import ConfigError, load_experiment

    schema._NOTED.clear()
    p = _experiment(tmp_path, "openrlhf:\n  rollout.n_samples_per_prompt: 2\n")
    cfg = load_experiment(p)
    assert cfg["openrlhf"]["rollout.n_samples_per_prompt"] == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "n_samples_per_prompt" in ln]
    assert len(lines) == 1 and "rollout.group_size" in lines[0] and "config convert" in lines[0]
    load_experiment(p)  # once per process
    assert "n_samples_per_prompt" not in capsys.readouterr().err
    both = _experiment(tmp_path, "rollout: {group_size: 2}\nopenrlhf:\n  rollout.n_samples_per_prompt: 2\n",
                       name="both.yaml")
    with pytest.raises(ConfigError, match="written twice; write rollout.group_size only"):
        load_experiment(both)


def test_converter_keeps_comments_and_meaning(tmp_path):
    from openrlhf_div.cli.config import convert_file
    from openrlhf_div.config import load_experiment

    old = ("extends: _tiny_cpu.yaml\nexperiment: exp_schema\nmethod: {name: grpo}\nopenrlhf:\n"
           "  # samples per prompt: the group\n  rollout.n_samples_per_prompt: 2\n"
           "  train.batch_size: 8  # not ours: stays\n  actor.adam.lr: 5e-4  # the step size\n"
           "  train.seed: ${SEED:-3}\n")
    p = _experiment(tmp_path, "", name="old.yaml")
    with open(p, "w") as fh:
        fh.write(old)
    before = load_experiment(p)
    new, moved = convert_file(p)
    assert len(moved) == 3
    assert "rollout:\n  # samples per prompt: the group\n  group_size: 2\n" in new
    assert "optim:\n  learning_rate: 5e-4  # the step size\n" in new and "seed: ${SEED:-3}\n" in new
    assert "openrlhf:\n  train.batch_size: 8  # not ours: stays\n" in new
    assert "n_samples_per_prompt" not in new and "actor.adam.lr" not in new
    with open(p, "w") as fh:
        fh.write(new)
    assert load_experiment(p) == before


def test_converter_command_writes(tmp_path):
    p = _experiment(tmp_path, "openrlhf:\n  rollout.batch_size: 2\n", name="w.yaml")
    r = subprocess.run([sys.executable, "-m", "openrlhf_div.cli.main", "config", "convert", "--write", p],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "1 setting(s) moved" in r.stderr
    data = yaml.safe_load(open(p))
    assert data["rollout"] == {"prompts_per_step": 2} and "openrlhf" not in data


def test_no_shipped_file_uses_an_old_spelling():
    """Every experiment file under configs/ is in the schema's names (and loads on the Ray side)."""
    from openrlhf_div.cli.config import convert_text

    for p in sorted(glob.glob(os.path.join(ROOT, "configs", "*", "*.yaml"))):
        with open(p) as fh:
            _, moved = convert_text(fh.read())
        assert not moved, f"{os.path.relpath(p, ROOT)}: {moved}"


def test_experiment_read_once_per_process(tmp_path, monkeypatch):
    """Issue 42 item 4: the launcher's plan and its plug-in loader both ask for the experiment; the
    files are read once per process (again only when one of the extends chain changed).
    Mutation: the cache lookup removed -> 2 reads of each file."""
    import time

    from openrlhf_div import config as C

    p = _experiment(tmp_path, "rollout: {group_size: 3}\n", name="once.yaml")
    reads = []
    real = C.read_yaml
    monkeypatch.setattr(C, "read_yaml", lambda path, what="config": reads.append(os.path.basename(path)) or real(path, what))
    a = C.load_experiment(p)
    a["openrlhf"]["rollout.n_samples_per_prompt"] = 99  # a caller's change does not reach the next caller
    b = C.load_experiment(p)
    assert sorted(reads) == ["_tiny_cpu.yaml", "math.yaml", "once.yaml"] and b["openrlhf"]["rollout.n_samples_per_prompt"] == 3
    base = os.path.join(os.path.dirname(p), "_tiny_cpu.yaml")
    time.sleep(0.01)
    with open(base, "a") as fh:
        fh.write("\n# touched\n")
    C.load_experiment(p)
    assert reads.count("_tiny_cpu.yaml") == 2


def test_converter_takes_the_old_div_spelling_too(tmp_path):
    """The converter of users' files is the package's (`config convert`), for both old spellings.
    Mutation: a method key left under div: (the method key branch removed) -> this test fails."""
    from openrlhf_div.cli.config import convert_file
    from openrlhf_div.config import load_experiment
    from openrlhf_div.engines.experiment import method_section, task_of

    old = ("extends: _tiny_cpu.yaml\nexperiment: exp_schema\ndiv:\n  method: dph_js\n  # the anchor weight\n"
           "  anchor_eta: 0.3\n  task: math\n  anchor_batch_size: 4\nopenrlhf:\n  rollout.batch_size: 2\n")
    p = _experiment(tmp_path, "", name="olddiv.yaml")
    with open(p, "w") as fh:
        fh.write(old)
    before = load_experiment(p)
    new, moved = convert_file(p)
    assert "div.method -> method.name" in moved and "div.anchor_eta -> method.anchor_eta" in moved
    assert "method:\n  name: dph_js\n  # the anchor weight\n  anchor_eta: 0.3\n" in new
    assert "optim:\n  anchor_batch_size: 4\n" in new and "task: math\n" in new
    with open(p, "w") as fh:
        fh.write(new)
    after = load_experiment(p)
    assert method_section(after) == method_section(before) == {"name": "dph_js", "anchor_eta": 0.3}
    assert task_of(after) == "math" and after["openrlhf"]["rollout.batch_size"] == 2


def test_a_closed_pipe_is_not_a_traceback(monkeypatch):
    """`openrlhf-div config fields | head -1`: the reader leaves early; no BrokenPipeError traceback,
    exit status 141 (as a shell reports SIGPIPE). Mutation: the BrokenPipeError branch of cli.main
    removed -> the error propagates (this test fails)."""
    from openrlhf_div.cli.main import main

    r, w = os.pipe()
    os.close(r)

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return w

    monkeypatch.setattr(sys, "stdout", Closed())
    try:
        assert main(["config", "fields"]) == 141
    finally:
        os.close(w)


def test_one_coercion_for_settings_and_hyperparameters():
    """Issue 42 item 4: the schema's fields, the method hyperparameters and the driver's bool flags
    convert through one function (schema.convert_scalar): the same spelling gives the same value.
    Mutation: convert_scalar reading ints with int() (no '1e3') -> the int cases fail on every reader."""
    import argparse

    from openrlhf_div.algorithms.registry import coerce_hparam
    from openrlhf_div.config import ConfigError
    from openrlhf_div.engines.flags import _bool
    from openrlhf_div.schema import coerce

    assert coerce("rollout.group_size", "int", "1e1") == 10 and coerce_hparam("micro_batch_seqs", "1e1") == 10
    assert coerce("optim.learning_rate", "float", "1e-3") == coerce_hparam("anchor_eta", "1e-3") == 0.001
    assert coerce("eval.max_prompts", "Optional[int]", "none") is None and coerce_hparam("dual_clip", "none") is None
    for word, val in (("yes", True), ("off", False)):
        assert coerce("logging.progress", "bool", word) is val and _bool(word) is val
    with pytest.raises(ConfigError, match="expects int"):
        coerce("rollout.group_size", "int", "8.5")
    with pytest.raises(ValueError, match="expected an integer"):
        coerce_hparam("micro_batch_seqs", "8.5")
    with pytest.raises(argparse.ArgumentTypeError):
        _bool("maybe")


def test_anchors_per_step_have_one_name(tmp_path, capsys):
    """`optim.anchor_ratio` (online samples per anchor sample) reaches the Ray driver as --div.anchor_ratio
    and the local engine as itself; the old div.anchor_ratio loads with one line and converts.
    Mutation: DIV_FLAGS emptied -> the Ray driver keeps its default 8."""
    from openrlhf_div import schema
    from openrlhf_div.cli.config import convert_file
    from openrlhf_div.config import load_experiment

    p = _experiment(tmp_path, "optim: {anchor_ratio: 4, learning_rate: 1e-4}\n", name="ratio.yaml")
    with open(p) as fh:
        text = fh.read().replace("method: {name: grpo}", "method: {name: dph_js}")
    with open(p, "w") as fh:
        fh.write(text + "data: {presample_dir: /tmp/none}\nopenrlhf: {train.batch_size: 20}\n")  # 16 online + 4 anchors
    plan = _ray_plan(p)
    assert plan.args.div.anchor_ratio == 4.0
    cfg = load_experiment(p)
    assert cfg["div"]["anchor_ratio"] == 4
    schema._NOTED.clear()
    old = _experiment(tmp_path, "div:\n  anchor_ratio: 4  # per anchor\nopenrlhf:\n  actor.adam.lr: 1e-4\n",
                      name="oldratio.yaml")
    before = load_experiment(old)
    assert "div.anchor_ratio is spelt optim.anchor_ratio" in capsys.readouterr().err
    new, moved = convert_file(old)
    assert "div.anchor_ratio -> optim.anchor_ratio" in moved and new.count("optim:") == 1
    assert "optim:\n  anchor_ratio: 4  # per anchor\n  learning_rate: 1e-4" in new or \
        "optim:\n  learning_rate: 1e-4\n  anchor_ratio: 4  # per anchor" in new, new
    with open(old, "w") as fh:
        fh.write(new)
    assert load_experiment(old) == before


def _dph(tmp_path, body: str, name: str) -> str:
    """A dph_js experiment over the tiny CPU family (16 online + 2 anchor rows per step)."""
    return _experiment(tmp_path, body + "openrlhf: {train.batch_size: 18}\n", name=name, method="dph_js")


def _presample_out(path, *over):
    """The Ray pre-sampling stage's output folder, as its driver parses it (its --dry-run's "out")."""
    import json

    from openrlhf_div.engines.openrlhf import presample as P

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert P.main(["--config", path, *over, "--dry-run"]) == 0
    return json.loads(buf.getvalue())["out"]


def test_the_presample_folder_has_one_name(tmp_path, monkeypatch):
    """`data.presample_dir` (issue 42: one name for the pre-sampling output): the Ray driver's
    --div.anchor_data, the Ray pre-sampling stage's output (--presample.out, not written in the file) and
    the local engine's data.presample_dir, all from the one key, ${VAR} expanded as the Ray side sees it;
    `--toy` pre-samples its own (no folder in its translation).
    Mutations: the DIV_FLAGS entry removed -> the Ray plan refuses data.presample_dir as local-only;
    presample_argv's default removed -> the stage has no output folder; to_local's line removed -> the
    local translation has none."""
    from openrlhf_div.engines import experiment as E

    monkeypatch.setenv("PRESAMPLE_DIR", str(tmp_path / "pre"))
    p = _dph(tmp_path, "data:\n  presample_dir: ${PRESAMPLE_DIR:-/nowhere}\npresample: {n_pre: 4, tau: 1}\n", "one.yaml")
    want = str(tmp_path / "pre")
    assert _ray_plan(p).args.div.anchor_data == want
    assert _presample_out(p) == want
    _, local = _local(p)
    assert local["data"]["presample_dir"] == want
    toy, _ = E.to_local(E.load(p, toy=True), run_dir="/tmp/x", toy=True)
    assert "presample_dir" not in (toy.get("data") or {})
    # an override moves all three
    assert _ray_plan(p, "data.presample_dir=/o").args.div.anchor_data == "/o"
    assert _presample_out(p, "data.presample_dir=/o") == "/o"
    assert _local(p, "data.presample_dir=/o")[1]["data"]["presample_dir"] == "/o"


def test_a_presample_out_flag_elsewhere_is_refused(tmp_path, capsys):
    """`--presample.out DIR` given to the Ray stage beside an experiment whose data.presample_dir is
    another folder used to win silently (the stage wrote where training does not read): now one line
    naming both folders and the override that moves both. The same folder, or a flag without an
    experiment, still runs. Mutation: the _refuse_second_folder call removed -> /elsewhere is accepted."""
    from openrlhf_div.engines.openrlhf import presample as P

    p = _dph(tmp_path, "data:\n  presample_dir: /d/pre\npresample: {n_pre: 4, tau: 1}\n", "flag.yaml")
    for flag in (["--presample.out", "/elsewhere"], ["--presample.out=/elsewhere"]):
        assert P.main(["--config", p, *flag, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == ("error: --presample.out /elsewhere: the experiment's data.presample_dir is /d/pre (the folder "
                       "training reads); pass data.presample_dir=/elsewhere instead (it moves both)"), err
    assert _presample_out(p, "--presample.out", "/d/pre/") == "/d/pre/"


def test_the_old_presample_names_note_or_refuse(tmp_path, capsys):
    """The old names of the folder still load, one stderr line each naming data.presample_dir:
    div.anchor_data, and presample.out when it is the same folder; a presample.out elsewhere (in the
    file, across its extends chain, or from an override) is refused in one line: training would not read
    what the stage writes. Mutation: presample_folder's comparison made to accept any pair -> the three
    refusals are not raised."""
    from openrlhf_div import schema
    from openrlhf_div.config import ConfigError, load_experiment
    from openrlhf_div.engines import experiment as E

    schema._NOTED.clear()
    old = _dph(tmp_path, "div: {anchor_data: /d/pre}\npresample: {out: /d/pre, n_pre: 4}\n", "old.yaml")
    cfg = load_experiment(old)
    err = capsys.readouterr().err.splitlines()
    for name in ("div.anchor_data", "presample.out"):
        lines = [ln for ln in err if name in ln]
        assert len(lines) == 1 and "is spelt data.presample_dir now" in lines[0] and "config convert" in lines[0], err
    assert cfg["div"]["anchor_data"] == "/d/pre"
    assert _presample_out(old) == "/d/pre" and _ray_plan(old).args.div.anchor_data == "/d/pre"
    bad = _dph(tmp_path, "data: {presample_dir: /d/pre}\npresample: {out: /d/other}\n", "bad.yaml")
    with pytest.raises(ConfigError, match=r"write to presample.out /d/other but training reads data.presample_dir /d/pre; remove presample.out"):
        load_experiment(bad)
    child = tmp_path / "configs" / "child.yaml"  # the folder in the file it extends, the old out in the child
    child.write_text("extends: old.yaml\npresample: {out: /d/other}\n")
    with pytest.raises(ConfigError, match="presample.out /d/other but training reads data.presample_dir /d/pre"):
        load_experiment(str(child))
    new = _dph(tmp_path, "data: {presample_dir: /d/pre}\n", "new.yaml")
    with pytest.raises(ConfigError, match="presample.out /d/other but training reads data.presample_dir /d/pre"):
        E.load(new, ["presample.out=/d/other"])
    assert "\n" not in str(pytest.raises(ConfigError, load_experiment, bad).value)


def test_the_converter_rewrites_the_toy_overlay(tmp_path, capsys):
    """A `toy:` overlay written in the old spelling (div.anchor_batch_size, div.anchor_eta, openrlhf's
    rollout.batch_size) loaded with notes telling the user to run `config convert`, which left it as it
    was: the overlay is converted one level down now, reported as `toy: ...`, and the converted file loads
    without a note and reads the same (the local translation with and without --toy, the toy's method).
    Mutation: the _convert_toy call removed -> the toy's div: stays (fails)."""
    from openrlhf_div import schema
    from openrlhf_div.cli.config import convert_file
    from openrlhf_div.engines import experiment as E

    body = ("toy:\n  # the toy's own scale\n  div:\n    anchor_batch_size: 2\n    anchor_eta: 0.3\n"
            "  openrlhf:\n    rollout.batch_size: 4\n    train.batch_size: 16\n\ndata: {presample_dir: runs/pre}\n")
    p = _experiment(tmp_path, body, name="toyold.yaml", method="dph_js")

    def seen(path):
        return ({toy: E.to_local(E.load(path, toy=toy), run_dir="/tmp/x", toy=toy)[0] for toy in (False, True)},
                E.method_section(E.load(path, toy=True)))

    schema._NOTED.clear()
    before = seen(p)
    assert "toy:): div.anchor_batch_size is spelt optim.anchor_batch_size" in capsys.readouterr().err
    new, moved = convert_file(p)
    assert sorted(moved) == ["openrlhf.rollout.batch_size -> rollout.prompts_per_step",
                             "toy: div.anchor_batch_size -> optim.anchor_batch_size",
                             "toy: div.anchor_eta -> method.anchor_eta"], moved
    assert ("toy:\n  # the toy's own scale\n  method:\n    anchor_eta: 0.3\n  optim:\n    anchor_batch_size: 2\n"
            in new), new
    assert "  div:" not in new and "\ndata: {presample_dir: runs/pre}\n" in new
    with open(p, "w") as fh:
        fh.write(new)
    schema._NOTED.clear()
    after = seen(p)
    assert "spelt" not in capsys.readouterr().err
    assert after == before and before[1]["anchor_eta"] == 0.3


def test_the_converter_gives_the_folder_one_name(tmp_path):
    """`config convert`: div.anchor_data -> data.presample_dir, presample.out (the same folder) dropped,
    a local.data.presample_dir equal to it dropped; the toy overlay's `presample_dir: null` kept (the toy
    pre-samples its own); every engine reads the converted file as before.
    Mutation: _convert_presample's body skipped -> `out:` and the local line stay (this test fails);
    _one_folder's normalisation skipped -> convert refuses (the file would load differently)."""
    from openrlhf_div import schema
    from openrlhf_div.cli.config import convert_file
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.openrlhf.presample import presample_argv

    schema._NOTED.clear()
    body = ("div:\n  anchor_data: runs/pre  # D_pef\n  anchor_batch_size: 4\n"
            "presample:\n  out: runs/pre\n  n_pre: 8\n"
            "local:\n  data:\n    presample_dir: runs/pre  # keep it equal\n    train_on_exp: false\n"
            "toy:\n  local:\n    data: {presample_dir: null}\nopenrlhf: {train.batch_size: 20}\n")
    p = _experiment(tmp_path, body, name="conv.yaml", method="dph_js")

    def seen(path):
        out = {}
        for toy in (False, True):
            cfg = E.load(path, toy=toy)
            out[toy] = E.to_local(cfg, run_dir="/tmp/x", toy=toy)[0]
        cfg = E.load(path)
        flags, flag = {}, None  # the driver's command line as {flag: values} (its order is the file's)
        for tok in _ray_plan(path).argv:
            if tok.startswith("--"):
                flag = tok
                flags.setdefault(flag, [])
            else:
                flags[flag].append(tok)
        return out, presample_argv(cfg), flags

    before = seen(p)
    new, moved = convert_file(p)
    assert moved == ["div.anchor_data -> data.presample_dir", "div.anchor_batch_size -> optim.anchor_batch_size",
                     "presample.out (= data.presample_dir, the stage's default) dropped",
                     "local.data.presample_dir (= data.presample_dir) dropped"], moved
    assert "data:\n  presample_dir: runs/pre  # D_pef\n" in new
    assert "anchor_data" not in new and "  out:" not in new and "keep it equal" not in new
    assert "local:\n  data:\n    train_on_exp: false\n" in new and "data: {presample_dir: null}" in new
    with open(p, "w") as fh:
        fh.write(new)
    after = seen(p)
    assert after == before
    assert before[0][False]["data"]["presample_dir"] == "runs/pre" and before[0][True]["data"]["presample_dir"] is None
    assert before[1][:2] == ["--presample.out", "runs/pre"]
    lone = tmp_path / "configs" / "lone.yaml"  # a presample.out without the folder: the folder's one name
    lone.write_text("extends: _tiny_cpu.yaml\nexperiment: lone\nmethod: {name: dph_js}\n"
                    "openrlhf: {train.batch_size: 18}\npresample:\n  out: /d/pre\n")
    new, moved = convert_file(str(lone))
    assert moved == ["presample.out -> data.presample_dir"]
    assert new.endswith("presample: {}\ndata:\n  presample_dir: /d/pre\n"), new
    lone.write_text(new)
    assert _presample_out(str(lone)) == "/d/pre" and _ray_plan(str(lone)).args.div.anchor_data == "/d/pre"


def test_the_local_presample_writes_where_training_reads():
    """The local `openrlhf-div presample`'s folder: --out, else presample.output_dir (the write side's
    override), else data.presample_dir (the folder training reads), else OUTPUT_DIR/presample.
    Mutation: data.presample_dir left out of output_folder -> OUTPUT_DIR/presample (this test fails)."""
    from openrlhf_div.engines.local.config import load_config
    from openrlhf_div.engines.local.presample import output_folder

    base = ["output_dir=/r", "task=math"]
    assert output_folder(load_config(None, base)) == "/r/presample"
    assert output_folder(load_config(None, base + ["data.presample_dir=/d"])) == "/d"
    assert output_folder(load_config(None, base + ["data.presample_dir=/d", "presample.output_dir=/w"])) == "/w"
    assert output_folder(load_config(None, base + ["data.presample_dir=/d"]), "/o") == "/o"
