"""The OpenRLHF reward files, loaded the way OpenRLHF loads them (a file path), no Ray."""
import asyncio
import importlib.util
import json
import os

import pytest
import torch

import openrlhf_div.tasks.reward_funcs as rf_pkg
from openrlhf_div.tasks.reward_funcs._common import response_from_query

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RF_DIR = os.path.dirname(rf_pkg.__file__)


def load_reward_file(name):
    # exactly what openrlhf.utils.agent.SingleTurnAgentExecutor does with --reward.remote_url
    spec = importlib.util.spec_from_file_location("reward_func", os.path.join(RF_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.reward_func


@pytest.fixture(scope="module")
def db_root(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("mk", os.path.join(ROOT, "tests", "tools", "make_fixture_db.py"))
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    root = tmp_path_factory.mktemp("dbs")
    mk.build_databases(str(root))
    return str(root)


PROMPT = "<|im_start|>user\nSolve it.<|im_end|>\n<|im_start|>assistant\n"


def test_response_from_query():
    assert response_from_query(PROMPT + "x = 1<|im_end|>", PROMPT) == "x = 1"
    assert response_from_query(PROMPT + "ok<|im_end|><|endoftext|><|endoftext|>", PROMPT) == "ok"
    assert response_from_query("<s>" + PROMPT + "ok</s>", PROMPT) == "ok"   # prompt not at the start
    assert response_from_query("whole text", "absent prompt") == "whole text"


def check_shapes(out, b):
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert out["rewards"].shape == out["scores"].shape == (b,)
    assert out["rewards"].dtype == torch.float32
    for v in out["extra_logs"].values():
        assert isinstance(v, torch.Tensor) and v.shape == (b,)


def test_math_reward_file():
    rf = load_reward_file("math")
    responses = [r"so \boxed{\frac{1}{2}}", "Answer: 0.5", r"\boxed{3}", "no idea", r"\boxed{10^{10^{10^{10}}}}"]
    out = rf([PROMPT + r + "<|im_end|>" for r in responses], [PROMPT] * 5, ["\\frac{1}{2}"] * 4 + ["1"],
             timeout=1.0, num_workers=2)
    check_shapes(out, 5)
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert out["extra_logs"]["no_answer"].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert out["extra_logs"]["verifier_timeout"].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_countdown_reward_file_scores_are_correctness():
    rf = load_reward_file("countdown")
    label = json.dumps({"target": 24, "numbers": [4, 6, 1]})
    responses = ["<answer>4*6*1</answer>", "<answer>4+6+1</answer>", "nothing"]
    out = rf([PROMPT + r for r in responses], [PROMPT] * 3, [label] * 3)
    check_shapes(out, 3)
    assert out["rewards"].tolist() == pytest.approx([1.0, 0.1, 0.0])
    assert out["scores"].tolist() == [1.0, 0.0, 0.0]  # the 0.1 format reward is not a success


def test_sql_reward_file_reads_db_root_from_the_environment(db_root, monkeypatch):
    monkeypatch.setenv("OPENRLHF_DIV_SQL_DB_ROOT", db_root)
    monkeypatch.setenv("OPENRLHF_DIV_SQL_TIMEOUT", "1.0")
    monkeypatch.setenv("OPENRLHF_DIV_VERIFIER_WORKERS", "2")
    rf = load_reward_file("sql")
    label = json.dumps({"db_id": "concert", "sql": "SELECT count(*) FROM singer"})
    responses = ["```sql\nSELECT count(singer_id) FROM singer\n```", "```sql\nDROP TABLE singer\n```",
                 "```sql\nSELECT 1\n```"]
    out = rf([PROMPT + r + "<|im_end|>" for r in responses], [PROMPT] * 3, [label] * 3)
    check_shapes(out, 3)
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]


def test_sql_reward_file_without_db_root_raises_naming_the_variable(monkeypatch):
    """Before: every reward was a silent 0 ("verifier error"), and GRPO learned nothing."""
    monkeypatch.delenv("OPENRLHF_DIV_SQL_DB_ROOT", raising=False)
    rf = load_reward_file("sql")
    with pytest.raises(RuntimeError, match="OPENRLHF_DIV_SQL_DB_ROOT is not set"):
        rf([PROMPT + "```sql\nSELECT 1\n```"], [PROMPT], [json.dumps({"db_id": "concert", "sql": "SELECT 1"})])


def test_sql_reward_file_missing_root_or_database_raises_naming_the_path(db_root, monkeypatch, tmp_path):
    rf = load_reward_file("sql")
    label = json.dumps({"db_id": "concert", "sql": "SELECT 1"})
    monkeypatch.setenv("OPENRLHF_DIV_SQL_DB_ROOT", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        rf([PROMPT + "```sql\nSELECT 1\n```"], [PROMPT], [label])
    monkeypatch.setenv("OPENRLHF_DIV_SQL_DB_ROOT", str(tmp_path))  # a folder, but without concert/
    with pytest.raises(FileNotFoundError, match="'concert' is in none of OPENRLHF_DIV_SQL_DB_ROOT"):
        rf([PROMPT + "```sql\nSELECT 1\n```"], [PROMPT], [label])


def test_sql_reward_file_takes_separate_train_and_eval_roots(db_root, monkeypatch, tmp_path):
    """One variable, two roots (BIRD train + dev databases): each db_id is found in its own."""
    import shutil

    train, dev = tmp_path / "train_databases", tmp_path / "dev_databases"
    train.mkdir()
    shutil.copytree(os.path.join(db_root, "concert"), dev / "concert")
    for name in os.listdir(db_root):
        if name != "concert" and os.path.isdir(os.path.join(db_root, name)):
            shutil.copytree(os.path.join(db_root, name), train / name)
    monkeypatch.setenv("OPENRLHF_DIV_SQL_DB_ROOT", f"{train}{os.pathsep}{dev}")
    monkeypatch.setenv("OPENRLHF_DIV_SQL_TIMEOUT", "1.0")
    rf = load_reward_file("sql")
    other = sorted(n for n in os.listdir(train))[0]
    labels = [json.dumps({"db_id": "concert", "sql": "SELECT count(*) FROM singer"}),
              json.dumps({"db_id": other, "sql": "SELECT 1"})]
    out = rf([PROMPT + "```sql\nSELECT count(singer_id) FROM singer\n```", PROMPT + "```sql\nSELECT 1\n```"],
             [PROMPT] * 2, labels)
    assert out["rewards"].tolist() == [1.0, 1.0]
    shutil.copytree(dev / "concert", train / "concert")  # the same id in both roots: ambiguous
    with pytest.raises(ValueError, match="more than one root"):
        rf([PROMPT + "x"], [PROMPT], labels[:1])


def test_called_concurrently_from_threads_like_openrlhf():
    """OpenRLHF calls reward_func(...) with one query per call via asyncio.to_thread."""
    rf = load_reward_file("math")
    cases = [(r"\boxed{\sqrt{2}/2}", r"\frac{1}{\sqrt{2}}", 1.0), (r"\boxed{x+1}", "x+2", 0.0),
             (r"\boxed{(0,1]}", "(0,1]", 1.0), (r"\boxed{\frac{6}{8}}", "0.75", 1.0)] * 3

    async def main():
        return await asyncio.gather(*[asyncio.to_thread(rf, [PROMPT + r], [PROMPT], [g], timeout=2.0, num_workers=2)
                                      for r, g, _ in cases])

    outs = asyncio.run(main())
    assert [o["rewards"].item() for o in outs] == [c[2] for c in cases]


def test_mismatched_lengths_raise_clearly():
    rf = load_reward_file("countdown")
    with pytest.raises(ValueError, match="2 queries, 1 prompts"):
        rf(["a", "b"], ["a"], ["{}", "{}"])
