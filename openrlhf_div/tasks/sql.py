"""Text-to-SQL (BIRD / Spider): schema prompts, SQL extraction and sandboxed execution accuracy.

Label: ``{"db_id": ..., "sql": gold}``; the database lives at
``{db_root}/{db_id}/{db_id}.sqlite`` (the BIRD and Spider layout). A response scores 1.0 when
its SQL returns the same result set as the gold SQL (BIRD's execution accuracy, see
:mod:`openrlhf_div.tasks.sqlite_sandbox` for the comparison and the sandbox), else 0.0.

The SQL of a response (:func:`extract_sql`): the last ```sql (or ```sqlite) block -- the first
with ``sql_block="first"``; other fences (a model's invented "Output" table, ```python) are
ignored. Without any sql-labelled block: the last bare ``` block that holds a ``SELECT``/``WITH``
query, else an unclosed final ```sql block (a truncated generation), else the last
``SELECT``/``WITH`` statement in the prose. Of several statements in the block, the last is
taken. Extraction is linear-time and reads the last (``"first"``: the first)
:data:`~openrlhf_div.tasks.base.MAX_EXTRACT_CHARS` characters of the response.

The prompt follows the DPH paper's SQL setup (OmniSQL-style): the database engine, the
schema as ``CREATE TABLE`` statements each followed by a few sample rows, the external
knowledge (BIRD's ``evidence``) and the question, asking for the query in a ```sql block.
"""
from __future__ import annotations

import os
import re
import sqlite3
import threading
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

from .base import RewardResult, Task, decode_label, extraction_window, register_task
from .sqlite_sandbox import SQLExecutor, open_readonly

__all__ = ["SQLTask", "extract_sql", "split_statements", "normalize_sql", "schema_text", "SQL_TEMPLATES"]

# --------------------------------------------------------------------------- extraction
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n?(.*?)```", re.DOTALL)
_OPEN_FENCE_RE = re.compile(r"```[ \t]*(?:sql|sqlite|SQL|SQLite)[ \t]*\n(.*)$", re.DOTALL)
_STMT_START_RE = re.compile(r"\b(SELECT|WITH)\b", re.IGNORECASE)


def split_statements(sql: str) -> List[str]:
    """Split on ``;`` outside string literals, quoted identifiers and comments, dropping empty
    and comment-only statements. One left-to-right pass (linear time: an unclosed ``/*`` or
    quote is scanned once, not once per ``;``)."""
    out: List[str] = []
    i, n, start, has_code = 0, len(sql), 0, False
    while i < n:
        c = sql[i]
        if c in "'\"`":
            j = sql.find(c, i + 1)
            while j != -1 and j + 1 < n and sql[j + 1] == c:  # '' inside a literal
                j = sql.find(c, j + 2)
            i, has_code = (n if j < 0 else j + 1), True
        elif c == "[":
            j = sql.find("]", i + 1)
            i, has_code = (n if j < 0 else j + 1), True
        elif c == "-" and sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif c == "/" and sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c == ";":
            if has_code:
                out.append(sql[start:i].strip())
            start, has_code, i = i + 1, False, i + 1
        else:
            if not c.isspace():
                has_code = True
            i += 1
    if has_code:
        out.append(sql[start:].strip())
    return out


def _looks_like_query(block: str) -> bool:
    stmts = split_statements(block)
    return bool(stmts) and bool(_STMT_START_RE.match(stmts[-1].lstrip("( \t\n")))


def extract_sql(text: str, block: str = "last") -> Optional[str]:
    """The SQL a response proposes (see the module docstring): the last (``block="first"``:
    the first) ```sql block, other fences ignored; then a bare fence holding a query, an
    unclosed final ```sql block, or a ``SELECT``/``WITH`` statement in the prose. Of several
    statements, the last is taken."""
    if block not in ("last", "first"):
        raise ValueError(f"extract_sql: block must be 'last' or 'first', got {block!r}")
    if not text:
        return None
    text = extraction_window(text, first=block == "first")
    pick = (lambda xs: xs[0]) if block == "first" else (lambda xs: xs[-1])
    candidate = None
    fences = _FENCE_RE.findall(text)
    sql_blocks = [b for lang, b in fences if b.strip() and lang.lower() in ("sql", "sqlite")]
    bare = [b for lang, b in fences if lang == "" and _looks_like_query(b)] if not sql_blocks else []
    if sql_blocks or bare:
        candidate = pick(sql_blocks or bare)
    else:
        m = _OPEN_FENCE_RE.search(text)
        if m and m.group(1).strip():
            candidate = m.group(1)
        else:
            starts = list(_STMT_START_RE.finditer(text))
            if starts:
                tail = text[pick(starts).start():]
                candidate = tail.split(";", 1)[0]
                # a statement written in prose ends at a blank line
                candidate = re.split(r"\n\s*\n", candidate, maxsplit=1)[0]
    if candidate is None:
        return None
    stmts = split_statements(candidate)
    return stmts[-1] if stmts else None


def normalize_sql(sql: str) -> str:
    """Case-folded, whitespace-collapsed SQL without a trailing ``;`` (a solution's identity
    for distinct-correct counts)."""
    s = re.sub(r"--[^\n]*", " ", sql)
    s = re.sub(r"\s+", " ", s).strip().rstrip(";").strip()
    return s.lower()


# --------------------------------------------------------------------------- schema / prompt
def _fmt_value(v: Any, max_chars: int) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bytes):
        return f"<blob {len(v)} bytes>"
    s = str(v).replace("\n", " ")
    if len(s) > max_chars:
        s = s[:max_chars] + "..."
    return repr(s) if isinstance(v, str) else s


def schema_text(db_path: str, sample_rows: int = 3, max_value_chars: int = 60, timeout: float = 5.0) -> str:
    """The database schema as ``CREATE TABLE`` statements, each followed by up to
    ``sample_rows`` sample rows in a comment. Read through the same read-only sandbox."""
    import time

    conn, deadline = open_readonly(db_path, heap_limit_mb=None)
    try:
        deadline.t = time.monotonic() + timeout
        tables = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
            "ORDER BY rowid").fetchall()
        parts = []
        for name, ddl in tables:
            part = (ddl or f"CREATE TABLE {name} (...)").strip().rstrip(";") + ";"
            if sample_rows > 0:
                quoted = '"' + name.replace('"', '""') + '"'
                deadline.t = time.monotonic() + timeout
                try:
                    cur = conn.execute(f"SELECT * FROM {quoted} LIMIT {int(sample_rows)}")
                    cols = [d[0] for d in cur.description]
                    rows = cur.fetchall()
                except sqlite3.Error:
                    cols, rows = [], []
                if rows:
                    lines = [" | ".join(cols)] + [" | ".join(_fmt_value(v, max_value_chars) for v in r) for r in rows]
                    part += f"\n/* {len(rows)} sample row{'s' if len(rows) != 1 else ''} from {name}:\n" \
                            + "\n".join(lines) + "\n*/"
            parts.append(part)
        return "\n\n".join(parts)
    finally:
        conn.close()


_DPH_SQL_TEMPLATE = (
    "Task overview:\nYou are a data science expert. Below are a database schema (with a few sample rows "
    "from each table), a natural-language question and, when available, external knowledge that helps "
    "to answer it. Write one SQL query that answers the question.\n\n"
    "Database engine:\nSQLite\n\n"
    "Database schema:\n{schema}\n\n"
    "{evidence_block}"
    "Question:\n{question}\n\n"
    "Instructions:\n- Return only the columns the question asks for.\n"
    "- Think step by step, then give the final query in a code block:\n```sql\n-- your SQL query\n```"
)

#: name -> (system message or None, user message)
SQL_TEMPLATES: Dict[str, Tuple[Optional[str], str]] = {
    "dph": (None, _DPH_SQL_TEMPLATE),
}


# --------------------------------------------------------------------------- the task
_DB_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\- ]*$")


def parse_sql_label(label: Any) -> Tuple[str, str]:
    """``(db_id, gold_sql)`` from a label dict or its JSON string."""
    label = decode_label(label, "sql", '{"db_id": ..., "sql": ...}')
    db_id = label.get("db_id")
    gold = label.get("sql", label.get("SQL", label.get("query")))
    if not db_id or not gold:
        raise ValueError(f"sql label needs 'db_id' and 'sql', got keys {sorted(label)}")
    return str(db_id), str(gold)


class SQLTask(Task):
    """BIRD/Spider text-to-SQL with sandboxed execution accuracy.

    Options: ``db_root`` (folder holding ``{db_id}/{db_id}.sqlite``), ``timeout`` (seconds
    per query, default 5; BIRD's own evaluator allows 30), ``max_rows`` (row cap, default
    10000), ``compare`` (``"set"`` = BIRD, ``"multiset"``, ``"ordered"``), ``float_round``
    (decimals, default None = exact), ``num_workers``, ``sample_rows`` (rows shown per table in
    the prompt, default 3), ``template`` (``"dph"``), ``heap_limit_mb`` (SQLite heap cap per
    worker, default 1024), ``max_result_mb`` (cap on the bytes of a fetched result, default 64:
    more scores 0 with reason ``"result too large"`` and the worker is replaced),
    ``address_space_mb`` (address-space limit of each worker above its start-up size, default
    2048), ``sql_block`` (``"last"``, the default, or ``"first"`` ```sql block).
    """

    name = "sql"

    def __init__(self, db_root: Optional[str] = None, timeout: float = 5.0, max_rows: int = 10_000,
                 compare: str = "set", float_round: Optional[int] = None, num_workers: Optional[int] = None,
                 sample_rows: int = 3, template: str = "dph", max_value_chars: int = 60,
                 heap_limit_mb: Optional[int] = 1024, max_result_mb: float = 64, address_space_mb: Optional[int] = 2048,
                 sql_block: str = "last"):
        if template not in SQL_TEMPLATES:
            raise ValueError(f"unknown sql template {template!r}; choose one of {sorted(SQL_TEMPLATES)}")
        if sql_block not in ("last", "first"):
            raise ValueError(f"sql option sql_block={sql_block!r}: choose 'last' or 'first' (which ```sql block "
                             "of a response is graded)")
        self.sql_block = sql_block
        self.db_root = db_root
        self.template = template
        self.sample_rows = int(sample_rows)
        self.max_value_chars = int(max_value_chars)
        self.executor = SQLExecutor(timeout=timeout, max_rows=max_rows, num_workers=num_workers,
                                    compare=compare, float_round=float_round, heap_limit_mb=heap_limit_mb,
                                    max_result_mb=max_result_mb, address_space_mb=address_space_mb)
        self._schema_cache: Dict[str, str] = {}
        self._lock = threading.Lock()

    @property
    def db_roots(self) -> List[str]:
        """``db_root`` split on ``os.pathsep``: one root may hold BIRD's train databases and
        another its dev databases (``/data/bird/train_databases:/data/bird/dev_databases``)."""
        return [r for r in str(self.db_root or "").split(os.pathsep) if r]

    def db_candidates(self, db_id: str) -> List[str]:
        """``{root}/{db_id}/{db_id}.sqlite`` under every root; rejects ids that could escape a root."""
        if not self.db_roots:
            raise ValueError("the sql task needs db_root (the folder holding {db_id}/{db_id}.sqlite); "
                             "pass get_task('sql', db_root=...) or --task-opt db_root=PATH")
        if not _DB_ID_RE.match(db_id) or ".." in db_id:
            raise ValueError(f"invalid db_id {db_id!r}: letters, digits, '_', '-', '.' and spaces only")
        return [os.path.join(r, db_id, f"{db_id}.sqlite") for r in self.db_roots]

    def db_path(self, db_id: str) -> str:
        """The database of ``db_id`` in the first root that has it (else the first root's path)."""
        paths = self.db_candidates(db_id)
        return next((p for p in paths if os.path.isfile(p)), paths[0])

    def schema(self, db_id: str) -> str:
        with self._lock:
            hit = self._schema_cache.get(db_id)
        if hit is None:
            hit = schema_text(self.db_path(db_id), self.sample_rows, self.max_value_chars)
            with self._lock:
                self._schema_cache[db_id] = hit
        return hit

    def prompt(self, example: Dict[str, Any]) -> List[Dict[str, str]]:
        db_id = example.get("db_id")
        if db_id is None:
            db_id, _ = parse_sql_label(example["label"])
        evidence = (example.get("evidence") or "").strip()
        system, user = SQL_TEMPLATES[self.template]
        text = (user.replace("{schema}", self.schema(db_id))
                .replace("{evidence_block}", f"External knowledge:\n{evidence}\n\n" if evidence else "")
                .replace("{question}", str(example["prompt"]).strip()))
        msgs = [{"role": "system", "content": system}] if system else []
        msgs.append({"role": "user", "content": text})
        return msgs

    def grading(self) -> str:
        return (f"sql: the {self.sql_block} ```sql block (other fences ignored), executed read-only and compared "
                f"as a {self.executor.compare} of rows with the gold result")

    def score(self, response: str, label: Any) -> RewardResult:
        return self.score_batch([response], [label])[0]

    def score_batch(self, responses: Sequence[str], labels: Sequence[Any]) -> List[RewardResult]:
        if len(responses) != len(labels):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(labels)} labels")
        out: List[Optional[RewardResult]] = [None] * len(responses)
        jobs, where = [], []
        for i, (resp, lab) in enumerate(zip(responses, labels)):
            try:
                db_id, gold = parse_sql_label(lab)
                path = self.db_path(db_id)
                if not os.path.isfile(path):
                    out[i] = RewardResult(0.0, False, f"database not found: {path}")
                    continue
                sql = extract_sql(resp or "", self.sql_block)
            except Exception as exc:  # noqa: BLE001
                out[i] = RewardResult(0.0, False, f"verifier error: {type(exc).__name__}: {exc}")
                continue
            if not sql:
                out[i] = RewardResult(0.0, False, "no SQL found", {"sql": None})
                continue
            jobs.append((path, sql, gold))
            where.append(i)
        if jobs:
            try:
                res = self.executor.compare_many(jobs)
            except Exception as exc:  # noqa: BLE001
                res = [{"correct": False, "reason": f"verifier error: {type(exc).__name__}: {exc}"}] * len(jobs)
            for i, (_, sql, _), r in zip(where, jobs, res):
                ok = bool(r.get("correct"))
                out[i] = RewardResult(float(ok), ok, r.get("reason", "ok"),
                                      {"sql": sql, "pred_rows": r.get("pred_rows"), "gold_rows": r.get("gold_rows")})
        return out  # type: ignore[return-value]

    def solution_key(self, response: str, result: RewardResult) -> Hashable:
        sql = (result.info or {}).get("sql") or extract_sql(response or "", self.sql_block)
        return normalize_sql(sql) if sql else " ".join((response or "").split())


register_task("sql", SQLTask)
