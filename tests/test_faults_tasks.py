"""Issue 14 (faults and hostile input), verifier side: each test reproduces one finding of the
fault campaign and failed before its fix. Also issue 16 item 5 (strict grading by default).

The time bounds below are functional limits (a stalled trainer), set 4x or more above what the
fixed code needs on a loaded 2-core machine and far below what the faulty code took (5-50 s);
the figures themselves are measured by ``benchmarks/measure_threats.py`` (docs/tasks.md)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from openrlhf_div.tasks import get_task
from openrlhf_div.tasks._pool import WorkerPool
from openrlhf_div.tasks.countdown import countdown_score
from openrlhf_div.tasks.math import extract_answer, quick_equal
from openrlhf_div.tasks.sql import extract_sql
from openrlhf_div.tasks.sqlite_sandbox import SQLExecutor, run_query

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def db_root(tmp_path_factory):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixture_db", os.path.join(ROOT, "tests", "tools", "make_fixture_db.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = tmp_path_factory.mktemp("dbs")
    mod.build_databases(str(root))
    return str(root)


def _fenced(sql):
    return f"```sql\n{sql}\n```"


# ------------------------------------------------------------------ 3. quadratic extraction
#: the issue's inputs, at the issue's sizes (old code: 5.9 s, 4.6 s, 28 s, 9.7 s)
SLOW_INPUTS = {
    "sql /* x (80 KB)": lambda: extract_sql("```sql\nSELECT 1 " + "/* x" * 20000),
    "sql /* x; (80 KB)": lambda: extract_sql("```sql\nSELECT 1 " + "/* x;" * 16000 + "\n```"),
    "sql prose /* x (80 KB)": lambda: extract_sql("SELECT " + "/* x" * 20000),
    "math \\boxed{ (28 KB)": lambda: extract_answer("\\boxed{" * 4000),
    "math phrase + 64 KB spaces": lambda: extract_answer("The answer is a" + " " * 65536 + "b"),
    "countdown <answer> (128 KB)": lambda: countdown_score("<answer>" * 16384, 10, [1, 2]),
}


@pytest.mark.parametrize("name", sorted(SLOW_INPUTS))
def test_extraction_of_hostile_long_responses_is_fast(name):
    t0 = time.perf_counter()
    SLOW_INPUTS[name]()
    assert time.perf_counter() - t0 < 2.0, name


def test_linear_extraction_keeps_its_answers():
    assert extract_answer("so \\boxed{\\frac{1}{\\boxed{2}}} and \\boxed{3") == ("2", "boxed")  # last-opened closed box
    assert extract_answer("\\boxed{a} then \\boxed{\\{x\\}}")[0] == "\\{x\\}"
    assert extract_answer("The answer is 5. I hope it is correct.")[0] == "5"
    assert extract_answer("The answer is a" + " " * 100 + "b")[0] == "a" + " " * 100 + "b"
    # the last complete <answer> pair counts, whatever unclosed tags precede it
    assert countdown_score("<answer>" * 50 + "<answer>1 + 2</answer>", 3, [1, 2])[0] == 1.0
    assert extract_sql("```sql\nSELECT 1 /* c; */ ; SELECT 'a;b' -- x;\n```") == "SELECT 'a;b' -- x;"


def test_only_the_tail_of_a_huge_response_is_read():
    from openrlhf_div.tasks.base import MAX_EXTRACT_CHARS

    junk = "x " * MAX_EXTRACT_CHARS
    assert extract_answer("\\boxed{7} " + junk)[0] is None          # beyond the window
    assert extract_answer(junk + " \\boxed{7}")[0] == "7"
    r = get_task("math").reward_result(junk + "\\boxed{7}", "7")
    assert r.reward == 1.0


# ------------------------------------------------------------------ 7. 2^{2^{2^{2^{2}}}}
def test_power_tower_equals_its_value():
    assert quick_equal("2^{2^{2^{2^{2}}}}", "2^{65536}") is True
    assert quick_equal("2^{2^{2^{2^{2}}}}", "2^{65535}") is False
    assert quick_equal("2^{16}", "65536") is True
    assert quick_equal("10^{10^{10}}", "5") is None  # too big to compute: left to math-verify (time-limited)
    task = get_task("math", timeout=2.0)
    r = task.reward_result("so \\boxed{2^{2^{2^{2^{2}}}}}", "2^{65536}")
    assert r.reward == 1.0 and r.reason == "ok", r


# ------------------------------------------------------------------ 16.5 strict grading
def test_math_grading_is_strict_by_default():
    resp = "32 - 30 = 2. I made a mistake."
    r = get_task("math").reward_result(resp, "2")
    assert r.reward == 0.0 and r.reason == "no answer found"
    lenient = get_task("math", extract="lenient")
    assert lenient.reward_result(resp, "2").reward == 1.0
    assert get_task("math").reward_result("The final answer is 2.", "2").reward == 1.0
    assert "strict" in get_task("math").grading() and "last number" in lenient.grading()
    with pytest.raises(ValueError, match="extract"):
        get_task("math", extract="loose")


def test_sql_takes_the_last_sql_block_and_ignores_other_fences():
    resp = "```sql\nSELECT a FROM t\n```\nOutput:\n```\nSELECT b FROM u\n```\n```text\n| a |\n```"
    assert extract_sql(resp) == "SELECT a FROM t"
    two = "```sql\nSELECT 1\n```\nbetter:\n```sqlite\nSELECT 2\n```\n```\n| 2 |\n```"
    assert extract_sql(two) == "SELECT 2"
    assert extract_sql(two, block="first") == "SELECT 1"
    # a bare fence still counts when there is no sql-labelled one and it holds a query
    assert extract_sql("```\nSELECT a FROM t\n```") == "SELECT a FROM t"
    assert extract_sql("```\n| a |\n```") is None
    task = get_task("sql", db_root="/nonexistent", sql_block="first")
    assert "first" in task.grading()
    with pytest.raises(ValueError, match="sql_block"):
        get_task("sql", db_root="/x", sql_block="middle")


# ------------------------------------------------------------------ 7. json_each
def test_json_each_is_allowed_and_schema_writes_still_refused(db_root, tmp_path):
    db = os.path.join(db_root, "concert", "concert.sqlite")
    assert run_query(db, "SELECT value FROM json_each('[1,2,3]')")["rows"] == [(1,), (2,), (3,)]
    assert run_query(db, "SELECT count(*) FROM singer, json_each('[1,2]')")["rows"] == [(10,)]
    assert run_query(db, "SELECT key FROM json_tree('{\"a\": 1}') WHERE key = 'a'")["ok"]
    for hostile in ("UPDATE sqlite_master SET type = 'x'", "UPDATE main.sqlite_master SET sql = ''",
                    "PRAGMA writable_schema = ON", "DELETE FROM sqlite_master",
                    "CREATE VIRTUAL TABLE v USING json_each", "INSERT INTO sqlite_master VALUES ('table','x','x',0,'')"):
        out = run_query(db, hostile)
        assert not out["ok"], hostile


# ------------------------------------------------------------------ 2. SQL memory and wall clock
def test_sql_result_over_the_byte_cap_scores_zero_and_replaces_the_worker(db_root):
    task = get_task("sql", db_root=db_root, timeout=5.0, num_workers=1, max_result_mb=2)
    pool = task.executor.pool
    gold = {"db_id": "concert", "sql": "SELECT 1"}
    big = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n+1 FROM r WHERE n<10000) SELECT zeroblob(900000) FROM r"
    kills = pool.kills
    r = task.reward_result(_fenced(big), gold)
    assert r.reward == 0.0 and r.reason == "pred error: result too large", r
    assert pool.kills == kills + 1  # killed and replaced: its memory goes back to the OS
    assert task.reward_result(_fenced("SELECT 1"), gold).reward == 1.0


def test_sql_worker_address_space_limit_turns_memory_growth_into_result_too_large(db_root):
    # a byte cap above the address-space limit: the limit itself must stop the fetch
    task = get_task("sql", db_root=db_root, timeout=10.0, num_workers=1, max_result_mb=100_000,
                    address_space_mb=300)
    gold = {"db_id": "concert", "sql": "SELECT 1"}
    big = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n+1 FROM r WHERE n<2000) SELECT zeroblob(1000000) FROM r"
    r = task.reward_result(_fenced(big), gold)
    assert r.reward == 0.0 and r.reason == "pred error: result too large", r
    assert task.reward_result(_fenced("SELECT 1"), gold).reward == 1.0


def _c_hang(*args):  # pragma: no cover - runs in a forked worker
    import re

    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # as a long C call: no alarm reaches it
    re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking inside the C regex engine
    return {"correct": True, "reason": "ok"}


def test_sql_hard_kill_at_the_time_limit(monkeypatch, db_root):
    """A query stuck in C code is killed at the time limit (+0.5 s), not at 2x + 1 s."""
    import openrlhf_div.tasks.sqlite_sandbox as sb

    monkeypatch.setenv("OPENRLHF_DIV_MP_CONTEXT", "fork")  # forked workers see the patched function
    monkeypatch.setattr(sb, "execute_and_compare", _c_hang)
    ex = SQLExecutor(timeout=1.0, num_workers=3)
    try:
        assert ex.pool.run("math:sqrt", [(4.0,)], timeout=30)[0].value == 2.0  # worker started outside the clock
        t0 = time.perf_counter()
        res = ex.compare_many([(os.path.join(db_root, "concert", "concert.sqlite"), "SELECT 1", "SELECT 1")])
        took = time.perf_counter() - t0
    finally:
        ex.pool.close()
    assert res[0]["reason"] == "sandbox: timeout"
    assert took < 2.7, took  # the kill comes at 1.5 s; the old hard limit was 2 * 1 + 1 = 3 s


# ------------------------------------------------------------------ 7. retry once after a crash
def crash_first_time(marker):  # runs in a forked worker
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return "second try"


def test_crashed_item_is_retried_once(tmp_path):
    with WorkerPool(1, name="retry", context="fork") as pool:
        res = pool.run(f"{__name__}:crash_first_time", [(str(tmp_path / "m"),)], timeout=5)
        assert res[0].ok and res[0].value == "second try"
        assert pool.retries == 1
        res = pool.run("os:_exit", [(1,)], timeout=5)  # crashes every time: reported after one retry
        assert res[0].error == "crash" and pool.retries == 2


# ------------------------------------------------------------------ 6. pools never run the caller's script
def test_plain_script_without_main_guard_runs_its_top_level_once(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""
        from openrlhf_div.tasks import get_task
        print("TOPLEVEL", flush=True)
        res = get_task("math").reward_results(["so \\\\boxed{\\\\sqrt{4}}", "\\\\boxed{x+1}"], ["2", "1+x"])
        print("RESULT", [(r.reward, r.reason) for r in res], flush=True)
    """))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OPENRLHF_DIV_MP_CONTEXT", None)
    for ctx in ("forkserver", "spawn"):
        env["OPENRLHF_DIV_MP_CONTEXT"] = ctx
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("TOPLEVEL") == 1, (ctx, out.stdout, out.stderr)
        assert "RESULT [(1.0, 'ok'), (1.0, 'ok')]" in out.stdout, (ctx, out.stdout)
        assert "bootstrapping" not in out.stdout + out.stderr


def test_eval_states_its_grading_mode():
    from openrlhf_div.eval.evaluate import evaluate, results_markdown

    task = get_task("math")
    gen = lambda prompts, n, **kw: [["\\boxed{2}"] * n for _ in prompts]  # noqa: E731
    res = evaluate(task, [{"prompt": "1+1", "label": "2", "source": "t", "id": "a"}], gen, n=2, ks=(1,),
                   progress=False)
    assert res["settings"]["grading"].startswith("math, strict")
    assert "grading: math, strict" in results_markdown(res)
