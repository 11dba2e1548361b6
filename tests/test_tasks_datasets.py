"""Dataset loaders: the usual layouts of each benchmark, Parquet / HF folders, malformed rows."""
import json
import os

import pytest

from openrlhf_div.tasks.datasets import DatasetError, load_examples

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def fx(*p):
    return os.path.join(FIX, *p)


def sql_fx(name):  # the SQL toy's data ship with the package (examples/data/toy_sql)
    return os.path.join(os.path.dirname(os.path.dirname(FIX)), "examples", "data", "toy_sql", name)


@pytest.mark.parametrize("path, source, first_id, prompt_start, label", [
    (fx("math", "math500.jsonl"), "math500", "test/prealgebra/1.json", "What is $\\frac{1}{2}", "\\frac{5}{6}"),
    (fx("math", "aime24.jsonl"), "aime24", "2024-I-1", "Find the remainder", "1"),
    (fx("math", "amc23.jsonl"), "amc23", "0", "What is $3", "27"),                 # 27.0 -> "27"
    (fx("math", "olympiadbench.jsonl"), "olympiadbench", "2001", "Find all real", "2, -2"),  # list answer
    (fx("math", "minerva.jsonl"), "minerva", "0", "A car travels", "60"),          # from \boxed in solution
    (fx("math", "dapo17k.jsonl"), "math_dapo", "a1b2c3d4-0001", "How many edges", "12"),  # chat + wrapper
])
def test_math_layouts(path, source, first_id, prompt_start, label):
    ex, summary = load_examples(path, "math")
    assert summary.loaded == len(ex) > 0 and summary.skipped == 0
    e = ex[0]
    assert set(e) == {"prompt", "label", "source", "id"}
    assert e["source"] == source and e["id"] == first_id and e["label"] == label
    assert e["prompt"].startswith(prompt_start)
    assert "Remember to put" not in e["prompt"] and "Solve the following" not in e["prompt"]


def test_sql_layouts():
    bird, _ = load_examples(sql_fx("bird_dev.json"), "sql")
    assert len(bird) == 4
    assert bird[0]["label"] == {"db_id": "school",
                                "sql": "SELECT COUNT(*) FROM schools WHERE county = 'Fresno' AND charter = 1"}
    assert bird[0]["evidence"] == "charter school refers to charter = 1" and bird[0]["id"] == "0"
    spider, _ = load_examples(sql_fx("spider_dev.json"), "sql")
    assert spider[1]["label"]["sql"].startswith("SELECT name FROM singer") and spider[1]["evidence"] == ""
    assert [e["id"] for e in spider] == ["spider_dev-0", "spider_dev-1", "spider_dev-2"]


def test_countdown_layout():
    ex, _ = load_examples(fx("countdown", "countdown.jsonl"), "countdown")
    assert ex[0]["label"] == {"target": 24, "numbers": [4, 6, 1]}


def test_parquet_and_hf_folder(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in open(fx("math", "dapo17k.jsonl"))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo-math-17k.parquet")
    ex, _ = load_examples(str(tmp_path / "dapo-math-17k.parquet"), "math", source="dapo17k")
    assert [e["label"] for e in ex] == ["12", "221"] and ex[1]["prompt"] == "What is $13 \\times 17$?"
    assert {e["source"] for e in ex} == {"dapo17k"}

    m500 = [json.loads(line) for line in open(fx("math", "math500.jsonl"))]
    d = datasets.DatasetDict({"test": datasets.Dataset.from_list(m500)})
    d.save_to_disk(str(tmp_path / "MATH-500"))
    ex, _ = load_examples(str(tmp_path / "MATH-500"), "math")
    assert len(ex) == 5 and ex[2]["label"] == "2\\sqrt{2}" and ex[0]["source"] == "MATH-500"


def test_generic_file_names_use_the_folder(tmp_path):
    d = tmp_path / "aime25"
    d.mkdir()
    (d / "test.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n')
    ex, _ = load_examples(str(d / "test.jsonl"), "math")
    assert ex[0]["source"] == "aime25" and ex[0]["id"] == "aime25-0"


def test_field_overrides(tmp_path):
    p = tmp_path / "custom.jsonl"
    p.write_text('{"q": "2+2?", "meta": {"gold": 4}, "key": "k1"}\n')
    ex, _ = load_examples(str(p), "math", prompt_field="q", label_field="meta.gold", id_field="key")
    assert ex[0] == {"prompt": "2+2?", "label": "4", "source": "custom", "id": "k1"}
    with pytest.raises(DatasetError, match=r"custom.jsonl:1: missing field 'nope'"):
        load_examples(str(p), "math", prompt_field="q", label_field="nope")


def test_malformed_rows_raise_with_file_and_line():
    with pytest.raises(DatasetError, match=r"malformed.jsonl:2: invalid JSON"):
        load_examples(fx("math", "malformed.jsonl"), "math")


def test_malformed_rows_skipped_and_counted(caplog):
    ex, summary = load_examples(fx("math", "malformed.jsonl"), "math", on_error="skip")
    assert [e["label"] for e in ex] == ["2", "8"]
    assert summary.loaded == 2 and summary.skipped == 3
    assert summary.errors[0].endswith("malformed.jsonl:2: invalid JSON (Expecting ',' delimiter at column 1)")
    assert ":4: no answer field" in summary.errors[1]
    assert ":6: expected a JSON object" in summary.errors[2]
    assert "skipped 3 malformed row(s)" in str(summary)
    assert any("skipped 3" in r.getMessage() for r in caplog.records)  # logged, not silent


def test_duplicate_ids_are_an_error_naming_both_lines_or_renamed_explicitly(tmp_path):
    p = tmp_path / "dups.jsonl"
    p.write_text('{"id": 1, "problem": "a", "answer": "1"}\n{"id": 2, "problem": "c", "answer": "3"}\n'
                 '{"id": 1, "problem": "b", "answer": "2"}\n')
    with pytest.raises(DatasetError, match=r"dups.jsonl:3: duplicate id '1'.*first at .*dups.jsonl:1"):
        load_examples(str(p), "math")
    ex, summary = load_examples(str(p), "math", duplicate_ids="rename")
    assert [e["id"] for e in ex] == ["1", "2", "1#1"] and summary.renamed_ids == 1


def test_bad_paths_and_formats(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_examples(str(tmp_path / "missing.jsonl"), "math")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported dataset format"):
        load_examples(str(tmp_path / "x.csv"), "math")
    (tmp_path / "broken.json").write_text('[{"problem": "a", "answer": 1},')
    with pytest.raises(DatasetError, match=r"broken.json:1: invalid JSON"):
        load_examples(str(tmp_path / "broken.json"), "math")
    with pytest.raises(ValueError, match="on_error"):
        load_examples(fx("math", "aime24.jsonl"), "math", on_error="ignore")


def test_limit():
    ex, _ = load_examples(fx("math", "math500.jsonl"), "math", limit=2)
    assert len(ex) == 2
