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
