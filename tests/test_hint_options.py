"""Error hints name only options that exist (issue 30): a data error of `openrlhf-div train` said
``pass on_error='skip' / --on-error skip``, options `train` does not have. Each command's data
errors (a malformed row, a duplicate id, a prompt over the limit) are produced on its real path,
and every option they name is parsed against that command: ``--flags`` against its argparse
parser, dotted ``section.key`` names against the local engine's config schema."""
import json
import re

import pytest

from openrlhf_div.cli.main import build_parser
from openrlhf_div.engines.local.config import load_config
from openrlhf_div.engines.local.data import load_task_examples
from openrlhf_div.tasks.datasets import DatasetError

FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
KEY = re.compile(r"\b([a-z_]+\.[a-z_]+)(?==|\b)")


def _bad_files(tmp_path):
    rows = {
        "malformed": [{"prompt": "1 + 1 =", "answer": "2"}, {"nothing": 1}],
        "duplicate": [{"prompt": "1 + 1 =", "answer": "2", "id": "x"}, {"prompt": "2 + 2 =", "answer": "4", "id": "x"}],
        "long": [{"prompt": "1 + 1 = " * 50, "answer": "2"}],
    }
    out = {}
    for name, rs in rows.items():
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rs))
        out[name] = str(p)
    return out


def _subparser(name):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices[name]


def _flags(parser):
    return {s for a in parser._actions for s in a.option_strings}


def test_train_data_errors_name_train_options(tmp_path):
    files = _bad_files(tmp_path)
    cfg = load_config(None, ["task=math", f"output_dir={tmp_path / 'run'}", "model.tiny_vocab=0123456789+= ",
                             f"data.train={files['malformed']}"])
    messages = []
    for name, path in files.items():
        with pytest.raises(DatasetError) as exc:
            load_task_examples(cfg, path, max_prompt_chars=100 if name == "long" else None)
        messages.append(str(exc.value))
    named = [m for msg in messages for m in KEY.findall(msg) if not m.endswith("jsonl")]
    assert named, messages  # the duplicate and the length errors name a train option
    for key in named:
        section, field = key.split(".")
        assert hasattr(getattr(cfg, section, None), field), f"hint names {key!r}, not a train option: {messages}"
    train_flags = _flags(_subparser("train"))
    for msg in messages:
        for flag in FLAG.findall(msg):
            assert flag in train_flags, f"hint names {flag}, not an option of `train`: {msg}"
        assert "on_error=" not in msg and "duplicate_ids='" not in msg  # the library's keywords


def test_eval_data_errors_name_eval_options(tmp_path, capsys):
    from openrlhf_div.cli.eval import DATA_HINTS
    from openrlhf_div.tasks.datasets import load_examples

    files = _bad_files(tmp_path)
    eval_flags = _flags(_subparser("eval"))
    messages = []
    for name, path in files.items():
        with pytest.raises(DatasetError) as exc:
            load_examples(path, "math", hints=DATA_HINTS, max_prompt_chars=100 if name == "long" else None)
        messages.append(str(exc.value))
    assert any(FLAG.search(m) for m in messages), messages
    for msg in messages:
        for flag in FLAG.findall(msg):
            assert flag in eval_flags, f"hint names {flag}, not an option of `eval`: {msg}"
        for key in KEY.findall(msg):
            assert key.endswith("jsonl"), f"hint names the config key {key!r}; `eval` takes flags: {msg}"
    # and the real command passes them: its error for a malformed row names --on-error
    from openrlhf_div.cli.main import main
    from openrlhf_div.engines.openrlhf.tiny_experiment import build_tiny_model

    model = build_tiny_model(str(tmp_path / "model"), warmup_steps=0)
    rc = main(["eval", "--model", model, "--task", "math", "--data", files["malformed"], "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--on-error skip" in err, err


def test_every_dotted_option_named_in_the_package_exists():
    """Every ``section.key=value`` any message of the package names (the hints of errors and log lines
    everywhere, not only data errors) is a key of the local engine's config schema (``method.*``:
    the method's hyperparameters, checked by the registry). An ``--`` flag of OpenRLHF's (e.g.
    ``--rollout.batch_size``) is not matched."""
    import ast
    import os

    import openrlhf_div

    pat = re.compile(r"(?<![\w.-])(model|rollout|optim|eval|data|checkpoint|presample|engine)\.([a-z_]+)=")
    cfg = load_config(None, ["task=math", "output_dir=unused"])
    root = os.path.dirname(openrlhf_div.__file__)
    named, bad = 0, []
    for folder, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    for m in pat.finditer(node.value):
                        named += 1
                        if not hasattr(getattr(cfg, m.group(1), None), m.group(2)):
                            bad.append(f"{os.path.relpath(path, root)}:{node.lineno}: {m.group(0)}")
    assert named > 20, named  # the scan sees the package's hints
    assert not bad, "hints name options the config does not have:\n" + "\n".join(bad)


# ------------------------------------------------------------------ --flags named anywhere
#: ``--flag`` in a message, ``--section.key`` included; ``\x00`` stands for an f-string's
#: replacement field, a trailing ``.*`` / ``*`` / ``.<key>`` names a family (``--div.<hparam>``)
FLAG_ANY = re.compile(r"(?<![\w-])(--[a-zA-Z][\w.\x00-]*[\w\x00])(\.?\*|\.<)?")
#: words that look like a flag in the package's prose and are no option of any command (each with
#: where and why)
NOT_OPTIONS = {
    "--flag": "engines/flags.py: the placeholder of a message template ('--flag is not supported')",
    "--make-vocab-size-divisible-by": "engines/megatron/weights.py: Megatron-LM's own argument, named to "
                                      "explain the padded vocabulary (megatron-core has no CLI of ours)",
    "--show-toplevel": "engines/local/runlog.py: git rev-parse's own option (own_commit)",
    "--short": "engines/local/runlog.py: git rev-parse's own option (own_commit)",
}


def _argparse_options_in_package(root):
    """Every option string the package's module CLIs define: ``add_argument("--x", ...)`` (memory_plan,
    prepare, head, config, ...) and the few parsed by hand (``"--warn-only" in argv``)."""
    import ast
    import os

    out = set()
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                tree = ast.parse(open(os.path.join(folder, f), encoding="utf-8").read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                        out |= {a.value for a in node.args if isinstance(a, ast.Constant)
                                and isinstance(a.value, str) and a.value.startswith("--")}
                    elif isinstance(node, ast.Compare):
                        out |= {c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)
                                and isinstance(c.value, str) and re.fullmatch(r"--[a-z][a-z-]*", c.value)}
    return out


def _launcher_options():
    """Options of the Ray launchers: ``python -m openrlhf_div.cli.train_ppo_ray`` (OpenRLHF 0.11.2's
    flags via engines/flags.py, ``--div.*``, ``--megatron.*``, ``--config``, ``--dry-run``, ...) and
    ``python -m openrlhf_div.cli.presample_ray`` (those + ``--presample.*``)."""
    from openrlhf_div.engines.openrlhf.launch import build_parser as ray_parser
    from openrlhf_div.engines.openrlhf.presample import add_presample_arguments

    p = ray_parser()
    add_presample_arguments(p)
    return _flags(p)


def _cli_options():
    """``openrlhf-div`` and every subcommand (train, eval, compare, run, presample, ...)."""
    parser = build_parser()
    out = _flags(parser)
    for a in parser._actions:
        if a.__class__.__name__ == "_SubParsersAction":
            for sub in a.choices.values():
                out |= _flags(sub)
    return out


def _ray_cli_options():
    """``ray start`` and ``ray job submit`` (Ray's click commands), named in the cluster hints."""
    import ray.scripts.scripts as ray_cli
    from ray.dashboard.modules.job.cli import job_cli_group

    cmds = [ray_cli.start, job_cli_group.commands["submit"]]
    return {o for c in cmds for prm in c.params for o in prm.opts if o.startswith("--")}


def _run_sh_options():
    """``examples/scripts/run.sh``'s own (the rest goes to the driver)."""
    import os

    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "scripts",
                             "run.sh"), encoding="utf-8").read()
    return set(re.findall(r'"(--[a-z-]+)"', text))


def _strings(tree):
    """``(lineno, text)`` of every string of a module; an f-string with ``\x00`` for each field."""
    import ast

    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                inside.add(id(v))
                parts.append(v.value if isinstance(v, ast.Constant) else "\x00")
            yield node.lineno, "".join(parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside:
            yield node.lineno, node.value


def scan_flags(root, *, cli, launcher, ray_cli, run_sh, own):
    """``(bad, named)``: ``bad`` lists ``(where, flag, why)`` for every ``--flag`` in a string of the
    package that no command has; ``named`` counts the flags checked.

    A dotted ``--section.key`` is an option of the Ray launchers (the only commands with dotted
    flags: OpenRLHF's via engines/flags.py, ``--div.*``, ``--megatron.*``, ``--presample.*``) or a
    family of them (``--div.<hparam>``, ``--actor.adam.*``); a plain ``--flag`` is an option of
    ``openrlhf-div`` (any subcommand), of a module CLI of the package, of ``run.sh``, of the Ray
    launchers or of the Ray commands the package runs and names (``ray start``, ``ray job submit``).
    An f-string's field matches any word (``--num-{res}s``: ``--num-gpus`` / ``--num-cpus``)."""
    import ast
    import os

    plain = cli | own | run_sh | launcher | ray_cli
    bad, named = [], 0
    for folder, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            for lineno, text in _strings(ast.parse(open(path, encoding="utf-8").read())):
                for m in FLAG_ANY.finditer(text):
                    flag, family = m.group(1), bool(m.group(2))
                    if flag in NOT_OPTIONS:
                        continue
                    named += 1
                    pool = launcher if "." in flag else plain
                    want = re.escape(flag).replace("\x00", "[\\w-]+")
                    ok = any(re.fullmatch(want + (r"[\w.-]*" if family else ""), o) for o in pool)
                    if not ok and not family and "." not in flag:  # --div: the group's name
                        ok = any(o.startswith(flag + ".") for o in launcher)
                    if not ok:
                        why = ("not an option of the Ray launchers (train_ppo_ray / presample_ray)" if "." in flag
                               else "not an option of openrlhf-div, its module CLIs, run.sh, the Ray launchers or "
                                    "ray start / ray job submit")
                        bad.append((f"{os.path.relpath(path, root)}:{lineno}", flag.replace("\x00", "{}"), why))
    return bad, named


def _scan_pools():
    import os

    import openrlhf_div

    root = os.path.dirname(openrlhf_div.__file__)
    return root, dict(cli=_cli_options(), launcher=_launcher_options(), ray_cli=_ray_cli_options(),
                      run_sh=_run_sh_options(), own=_argparse_options_in_package(root))


def test_every_flag_named_in_the_package_exists():
    """Every ``--flag`` any string of the package names (error hints, log lines, help texts,
    docstrings) exists as an option of the command it belongs to (see :func:`scan_flags`): a
    misspelt or removed option in a hint fails here."""
    pytest.importorskip("openrlhf")
    pytest.importorskip("ray")
    root, pools = _scan_pools()
    bad, named = scan_flags(root, **pools)
    assert named > 200, named  # the scan sees the package's hints
    assert not bad, "strings name options no command has:\n" + "\n".join(f"{w}: {f} ({why})" for w, f, why in bad)


def test_the_flag_scan_catches_a_misspelt_option(tmp_path):
    """The scan fails on a misspelt flag (a copy of a real hint with one letter changed)."""
    pytest.importorskip("openrlhf")
    pytest.importorskip("ray")
    _, pools = _scan_pools()
    (tmp_path / "hint.py").write_text(
        'A = "make --rollout.batch_size x n a multiple; or pass --vllm.num_engine 2"\n'
        'B = "start the head with `ray start --head --num-gpu 4`"\n'
        'C = "pass --on-eror skip"\n'
        'D = "set --div.anchor_eta, --div.* and ray start --num-gpus 4, --resume DIR"\n')
    (tmp_path / "fstr.py").write_text('n = 3\nE = f"ray start --num-{n}gpus and --num-gpus {n}"\n')
    bad, named = scan_flags(str(tmp_path), **pools)
    assert sorted(f for _, f, _ in bad) == ["--num-gpu", "--num-{}gpus", "--on-eror", "--vllm.num_engine"], bad
    assert named == 11, named
