"""SQL task: extraction, BIRD-style result comparison, the sandbox against hostile queries."""
import hashlib
import importlib.util
import json
import os
import sqlite3

import pytest

from openrlhf_div.tasks import get_task, render_prompt
from openrlhf_div.tasks.sql import extract_sql, normalize_sql, split_statements
from openrlhf_div.tasks.sqlite_sandbox import compare_results, open_readonly, run_query

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_script():
    spec = importlib.util.spec_from_file_location("make_fixture_db", os.path.join(ROOT, "tests", "tools", "make_fixture_db.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def db_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("dbs")
    _load_script().build_databases(str(root))
    return str(root)


@pytest.fixture(scope="module")
def task(db_root):
    # short per-query limit so hostile-query tests stay quick
    return get_task("sql", db_root=db_root, timeout=1.0, num_workers=2)


def sha(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def fenced(sql):
    return f"Let me think.\n```sql\n{sql}\n```"


# ------------------------------------------------------------------ extraction
@pytest.mark.parametrize("text, expected", [
    ("```sql\nSELECT 1\n```", "SELECT 1"),
    ("first ```sql\nSELECT 1\n``` then better ```sql\nSELECT 2;\n```", "SELECT 2"),
    ("```\nSELECT a FROM t\n```", "SELECT a FROM t"),
    ("```python\nprint(1)\n```\nSo: SELECT x FROM y;", "SELECT x FROM y"),
    ("The query is SELECT name FROM singer WHERE age > 3; done", "SELECT name FROM singer WHERE age > 3"),
    ("```sql\nSELECT 1;\nSELECT 'a;b' AS c;\n```", "SELECT 'a;b' AS c"),   # last statement; ';' in a string
    ("truncated ```sql\nSELECT count(*) FROM t", "SELECT count(*) FROM t"),
    ("```sql\nWITH c AS (SELECT 1 AS x) SELECT x FROM c\n```", "WITH c AS (SELECT 1 AS x) SELECT x FROM c"),
    ("no query here", None),
    ("```sql\n-- only a comment\n```", None),
])
def test_extract_sql(text, expected):
    assert extract_sql(text) == expected


def test_split_and_normalize():
    assert split_statements("SELECT 1; SELECT ';' ; -- c\n") == ["SELECT 1", "SELECT ';'"]
    assert normalize_sql("SELECT  a\n FROM t ;") == "select a from t"


# ------------------------------------------------------------------ comparison
@pytest.mark.parametrize("pred, gold, mode, expected", [
    ([(1,), (2,)], [(2,), (1,)], "set", True),           # order ignored (BIRD)
    ([(1,), (1,), (2,)], [(1,), (2,)], "set", True),     # duplicates ignored (BIRD)
    ([(1,), (1,), (2,)], [(1,), (2,)], "multiset", False),
    ([(1,), (2,), (1,)], [(1,), (1,), (2,)], "multiset", True),
    ([(1,), (2,)], [(2,), (1,)], "ordered", False),
    ([(None, "a")], [(None, "a")], "set", True),         # NULL equals NULL
    ([(None,)], [(0,)], "set", False),
    ([(1,)], [(1.0,)], "set", True),                     # 1 == 1.0
    ([(0.1 + 0.2,)], [(0.3,)], "set", False),            # floats exact by default, as BIRD
    ([], [], "set", True),
    ([(1, 2)], [(2, 1)], "set", False),                  # column order matters
])
def test_compare_results(pred, gold, mode, expected):
    assert compare_results(pred, gold, mode) is expected


def test_compare_float_rounding():
    assert compare_results([(0.1 + 0.2,)], [(0.3,)], float_round=6) is True
    assert compare_results([(0.31,)], [(0.3,)], float_round=6) is False
    with pytest.raises(ValueError, match="compare"):
        compare_results([], [], "bag")


# ------------------------------------------------------------------ execution accuracy
GOLD_COUNT = {"db_id": "school", "sql": "SELECT COUNT(*) FROM schools WHERE county = 'Fresno' AND charter = 1"}


def test_execution_accuracy(task):
    gold_cities = {"db_id": "school", "sql": "SELECT city FROM schools WHERE county = 'Mono'"}
    cases = [
        (fenced("SELECT count(*) FROM schools WHERE charter = 1 AND county = 'Fresno'"), GOLD_COUNT, True),
        (fenced("SELECT count(cds_code) FROM schools WHERE charter = 1"), GOLD_COUNT, False),  # 2 vs 1
        # NULL city kept in both: same set
        (fenced("SELECT city FROM schools WHERE county = 'Mono' ORDER BY city DESC"), gold_cities, True),
        (fenced("SELECT city FROM schools WHERE county = 'Mono' AND city IS NOT NULL"), gold_cities, False),
        (fenced("SELECT nme FROM schools"), GOLD_COUNT, False),  # SQL error
        ("I cannot answer.", GOLD_COUNT, False),
    ]
    res = task.reward_results([c[0] for c in cases], [c[1] for c in cases])
    assert [r.correct for r in res] == [c[2] for c in cases]
    assert res[0].reason == "ok" and res[0].info["pred_rows"] == res[0].info["gold_rows"] == 1
    assert res[1].reason == "wrong result"
    assert res[4].reason.startswith("pred error: OperationalError: no such column")
    assert res[5].reason == "no SQL found"


def test_labels_as_json_strings_and_spider_db(task):
    lab = json.dumps({"db_id": "concert", "sql": "SELECT name FROM singer WHERE age = 29"})
    assert task.reward(fenced("SELECT name FROM singer WHERE age < 30"), lab) == 1.0
    assert task.reward(fenced("SELECT name FROM singer"), lab) == 0.0


def test_bad_labels_and_missing_db_score_zero(task):
    r = task.reward_result(fenced("SELECT 1"), {"db_id": "nope", "sql": "SELECT 1"})
    assert r.reward == 0.0 and r.reason.startswith("database not found")
    r = task.reward_result(fenced("SELECT 1"), {"db_id": "../../etc", "sql": "SELECT 1"})
    assert r.reward == 0.0 and "invalid db_id" in r.reason
    r = task.reward_result(fenced("SELECT 1"), "not json")
    assert r.reward == 0.0 and "not valid JSON" in r.reason
    r = task.reward_result(fenced("SELECT 1"), {"db_id": "school", "sql": "SELECT nope FROM schools"})
    assert r.reward == 0.0 and r.reason.startswith("gold error")


HOSTILE = [
    "DELETE FROM schools",
    "UPDATE schools SET name = 'x'",
    "INSERT INTO schools(cds_code, name) VALUES ('9', 'x')",
    "DROP TABLE schools",
    "CREATE TABLE evil(a)",
    "CREATE TEMP TABLE evil AS SELECT 1",
    "ALTER TABLE schools ADD COLUMN evil",
    "ATTACH DATABASE '{tmp}/evil.sqlite' AS evil",
    "VACUUM INTO '{tmp}/copy.sqlite'",
    "PRAGMA writable_schema = ON",
    "PRAGMA journal_mode = WAL",
    "PRAGMA user_version = 7",
    "SELECT load_extension('{tmp}/evil.so')",
    "BEGIN IMMEDIATE",
    "SAVEPOINT s1",
    "REINDEX",
    "ANALYZE",
    "SELECT 1; DROP TABLE schools",
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
    "SELECT count(*) FROM numbers a, numbers b, numbers c, numbers d",
    "SELECT * FROM numbers a, numbers b",   # 90,000 rows > the 10,000-row cap
    "SELECT randomblob(2000000000)",
    "SELECT zeroblob(2000000000)",
]


def test_hostile_queries_score_zero_and_leave_the_database_untouched(task, db_root, tmp_path):
    db = os.path.join(db_root, "school", "school.sqlite")
    before = sha(db)
    files_before = sorted(os.listdir(os.path.dirname(db)))
    queries = [q.replace("{tmp}", str(tmp_path)) for q in HOSTILE]
    res = task.reward_results([fenced(q) for q in queries], [GOLD_COUNT] * len(queries))
    for q, r in zip(queries, res):
        assert r.reward == 0.0, (q, r)
        assert r.reason.startswith(("pred error", "sandbox")), (q, r)
    reasons = dict(zip(HOSTILE, (r.reason for r in res)))
    # runaway queries are stopped by the time limit, big results by the row cap
    assert reasons[HOSTILE[18]] == "pred error: timeout"
    assert reasons[HOSTILE[19]] == "pred error: timeout"
    assert reasons[HOSTILE[20]] == "pred error: row cap exceeded (> 10000 rows)"
    assert "too big" in reasons[HOSTILE[21]]
    assert sha(db) == before
    assert sorted(os.listdir(os.path.dirname(db))) == files_before  # no journal/WAL/side files
    assert os.listdir(tmp_path) == []  # ATTACH / VACUUM INTO created nothing
    # and the sandbox still answers correctly afterwards
    assert task.reward(fenced("SELECT count(*) FROM schools WHERE county='Fresno' AND charter=1"), GOLD_COUNT) == 1.0


def test_worker_crash_is_contained(task, db_root):
    """A worker that dies mid-query (here: killed from inside via a job) scores 0 and is
    replaced; the caller never sees an exception."""
    pool = task.executor.pool
    res = pool.run("os:_exit", [(1,)], timeout=5)
    assert res[0].error == "crash"
    assert task.reward(fenced("SELECT count(*) FROM schools WHERE county='Fresno' AND charter=1"), GOLD_COUNT) == 1.0


def test_run_query_in_process_guards(db_root):
    db = os.path.join(db_root, "concert", "concert.sqlite")
    assert run_query(db, "SELECT count(*) FROM singer")["rows"] == [(5,)]
    assert run_query(db, "PRAGMA table_info(singer)")["ok"]  # introspection is read-only: allowed
    out = run_query(db, "DELETE FROM singer")
    assert not out["ok"] and "not authorized" in out["error"]
    assert run_query(db, "SELECT * FROM singer", max_rows=2)["error"] == "row cap exceeded (> 2 rows)"
    with pytest.raises(FileNotFoundError, match="not found"):
        open_readonly(os.path.join(db_root, "missing.sqlite"))
    # even without the authorizer, the read-only URI refuses writes
    conn = sqlite3.connect("file:" + db + "?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        conn.execute("DELETE FROM singer")
    conn.close()


def test_prompt_has_schema_sample_rows_question_and_evidence(task):
    ex = {"prompt": "How many charter schools are there in Fresno county?", "evidence": "charter = 1",
          "db_id": "school", "label": GOLD_COUNT, "source": "bird", "id": "0"}
    text = render_prompt(task.prompt(ex), None)
    assert "CREATE TABLE schools" in text and "CREATE TABLE sat_scores" in text
    assert "3 sample rows from schools" in text and "'Alameda High'" in text
    assert "External knowledge:\ncharter = 1" in text
    assert "Question:\nHow many charter schools are there in Fresno county?" in text
    assert "```sql" in text
    spider = dict(ex, evidence="", db_id="concert")
    assert "External knowledge" not in render_prompt(task.prompt(spider), None)


def test_solution_key_is_normalized_sql(task):
    r = task.reward_result(fenced("SELECT  count(*)\nFROM schools WHERE county='Fresno' AND charter=1;"), GOLD_COUNT)
    assert task.solution_key("", r) == "select count(*) from schools where county='fresno' and charter=1"


def test_needs_db_root():
    t = get_task("sql")
    r = t.reward_result(fenced("SELECT 1"), GOLD_COUNT)
    assert r.reward == 0.0 and "db_root" in r.reason
