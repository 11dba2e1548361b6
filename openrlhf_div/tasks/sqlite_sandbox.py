"""Sandboxed SQLite execution and BIRD-style execution accuracy.

Model-written SQL is hostile input. Every query here runs under six guards:

1. the database is opened **read-only** through a URI (``file:...?mode=ro``);
2. an **authorizer** that denies by default: only ``SELECT``, column reads, recursive CTEs
   and ordinary functions pass; writes, DDL, ``ATTACH``/``DETACH`` (which also stops
   ``VACUUM INTO``), transactions, savepoints, ``PRAGMA`` (bar a few read-only introspection
   pragmas) and ``load_extension`` are refused at prepare time;
3. a **progress handler** aborts a statement once it has run ``timeout`` seconds (infinite
   recursive CTEs, huge cross joins), plus SQLite limits on value length and heap size;
4. a **row cap** and a **byte cap**: at most ``max_rows`` rows and ``max_result_mb`` MB of
   values are fetched into Python; more is an error (``"row cap exceeded"``, ``"result too
   large"``), not a silent cut;
5. queries run in **worker processes** (:class:`~openrlhf_div.tasks._pool.WorkerPool`) that
   the parent kills at a hard deadline -- the time limit plus 0.5 s, for a hang inside C code
   that neither the progress handler nor a signal reaches -- so a crash or a hang cannot take
   the trainer down; a crashed worker's job is retried once on a fresh worker;
6. each worker has an **address-space limit** (``RLIMIT_AS``: its size at start-up plus
   ``address_space_mb``): memory growth that slips past the caps ends in a ``MemoryError``,
   reported as ``"result too large"``; after either memory outcome the worker is replaced, so
   its memory goes back to the operating system.

The (predicted, gold) pair of a job shares one time limit: the predicted query may use all of
it, the gold query (cached per worker after its first run) what is left.

``json_each``/``json_tree`` are allowed: constructing these eponymous virtual tables asks the
authorizer for an ``UPDATE`` of the schema row's columns (``sqlite_master``: ``type``, ``name``,
``tbl_name``, ``rootpage``, ``sql``), which is granted for those columns of ``main`` only.
Nothing can write through it: the connection is read-only (``mode=ro``), ``PRAGMA
writable_schema`` is refused (without it SQLite refuses any change to ``sqlite_master``), and
``CREATE VIRTUAL TABLE`` stays denied, so a real ``UPDATE sqlite_master`` still fails (tested).

Execution accuracy (BIRD's evaluator): run the predicted and the gold query and compare the
result rows **as sets** -- row order and duplicate rows do not matter, ``NULL`` equals
``NULL``, ``1`` equals ``1.0`` (Python equality), floats compare exactly. Options:
``compare="multiset"`` (duplicates matter), ``"ordered"`` (order matters), and
``float_round=d`` (round floats to ``d`` decimals first, forgiving summation-order noise).
"""
from __future__ import annotations

import os
import resource
import sqlite3
import time
import urllib.parse
from collections import Counter, OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["open_readonly", "run_query", "execute_and_compare", "compare_results", "SQLExecutor"]

_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_DENIED_FUNCTIONS = {"load_extension", "fts3_tokenizer", "readfile", "writefile", "edit", "sqlite_dbpage"}
#: read-only schema introspection pragmas a query may use (``PRAGMA table_info(t)``; the
#: table-valued ``pragma_table_info()`` form stays denied: it needs an internal schema write)
_INTROSPECTION_PRAGMAS = {"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo",
                          "foreign_key_list", "table_list"}

#: the schema row a virtual table's constructor asks to update (never written: see the docstring)
_VTAB_SCHEMA_COLUMNS = {"type", "name", "tbl_name", "rootpage", "sql"}


def _authorizer(action, arg1, arg2, dbname, source):
    if action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master" and arg2 in _VTAB_SCHEMA_COLUMNS \
            and dbname == "main":
        return sqlite3.SQLITE_OK  # json_each()/json_tree() construction (see the module docstring)
    if action in _ALLOWED_ACTIONS:
        if action == sqlite3.SQLITE_FUNCTION and arg2 and arg2.lower() in _DENIED_FUNCTIONS:
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and arg1 and arg1.lower() in _INTROSPECTION_PRAGMAS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


class _Deadline:
    """Progress-handler state: the statement's deadline (``time.monotonic()`` seconds)."""

    __slots__ = ("t",)

    def __init__(self):
        self.t = float("inf")

    def __call__(self) -> int:
        return 1 if time.monotonic() > self.t else 0  # non-zero aborts the statement


def open_readonly(db_path: str, *, max_value_bytes: int = 10_000_000,
                  heap_limit_mb: Optional[int] = 1024) -> Tuple[sqlite3.Connection, _Deadline]:
    """Open ``db_path`` read-only with the authorizer, limits and a progress handler installed.

    Returns ``(connection, deadline)``; set ``deadline.t = time.monotonic() + timeout`` before
    each statement. Raises ``FileNotFoundError`` naming the path if the file is missing.
    """
    if not os.path.isfile(db_path):
        raise FileNotFoundError(f"SQLite database not found: {db_path}")
    uri = "file:" + urllib.parse.quote(os.path.abspath(db_path)) + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    if heap_limit_mb:
        # process-wide hard cap on SQLite's heap: a runaway sort/aggregate fails with
        # "out of memory" instead of exhausting the machine (set before the authorizer; the
        # workers set it, the parent passes None so the trainer's own SQLite use is untouched)
        conn.execute(f"PRAGMA hard_heap_limit = {int(heap_limit_mb) * 1024 * 1024}")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, int(max_value_bytes))  # randomblob(1e9) and friends
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.set_authorizer(_authorizer)
    deadline = _Deadline()
    conn.set_progress_handler(deadline, 10_000)  # ~every 10k VM steps: <1 ms late, ~2% overhead
    return conn, deadline


# ----------------------------------------------------------------------- worker-side state
_CONNS: "OrderedDict[str, Tuple[sqlite3.Connection, _Deadline]]" = OrderedDict()
_GOLD_CACHE: "OrderedDict[tuple, Dict[str, Any]]" = OrderedDict()
_MAX_CONNS = 16
_MAX_GOLD = 512
_GOLD_CACHE_MAX_ROWS = 2000


def _conn_for(db_path: str, heap_limit_mb: Optional[int]):
    key = os.path.abspath(db_path)
    hit = _CONNS.get(key)
    if hit is not None:
        _CONNS.move_to_end(key)
        return hit
    hit = open_readonly(key, heap_limit_mb=heap_limit_mb)
    _CONNS[key] = hit
    while len(_CONNS) > _MAX_CONNS:
        _, (old, _) = _CONNS.popitem(last=False)
        old.close()
    return hit


def _value_bytes(v) -> int:
    if isinstance(v, (str, bytes)):
        return len(v) + 48
    return 32


def run_query(db_path: str, sql: str, timeout: float = 5.0, max_rows: int = 10_000,
              heap_limit_mb: Optional[int] = 1024, max_result_mb: Optional[float] = 64) -> Dict[str, Any]:
    """Run one statement under the guards. Returns ``{"ok": True, "rows": [...]}`` or
    ``{"ok": False, "error": "..."}`` (``"timeout"``, ``"row cap exceeded (> N rows)"``,
    ``"result too large"``, ``"not authorized"``, the SQLite message, ...). Never raises for a
    bad query. Rows are fetched one at a time while their size is counted; a result over
    ``max_result_mb`` (or a ``MemoryError``) asks the pool to replace this worker."""
    from ._pool import request_recycle

    try:
        conn, deadline = _conn_for(db_path, heap_limit_mb)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": f"cannot open database: {type(exc).__name__}: {exc}"}
    deadline.t = time.monotonic() + timeout
    cap = float("inf") if not max_result_mb else float(max_result_mb) * 1024 * 1024
    cur = None
    rows: List[tuple] = []
    try:
        cur = conn.execute(sql)
        size = 0
        for r in cur:  # one row at a time: a single row can be 10 MB (SQLITE_LIMIT_LENGTH)
            rows.append(r)
            if len(rows) > max_rows:
                return {"ok": False, "error": f"row cap exceeded (> {max_rows} rows)"}
            size += sum(_value_bytes(v) for v in r)
            if size > cap:
                rows = []
                request_recycle()
                return {"ok": False, "error": "result too large"}
        return {"ok": True, "rows": rows}
    except MemoryError:
        rows = []
        request_recycle()
        return {"ok": False, "error": "result too large"}
    except sqlite3.OperationalError as exc:
        msg = str(exc)
        if msg == "interrupted" or time.monotonic() > deadline.t:
            return {"ok": False, "error": "timeout"}
        return {"ok": False, "error": f"OperationalError: {msg}"}
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        deadline.t = float("inf")
        if cur is not None:
            try:
                cur.close()
            except Exception:  # noqa: BLE001
                pass


def limit_address_space(extra_mb: Optional[int]) -> None:
    """Worker initializer: ``RLIMIT_AS`` = the current address-space size + ``extra_mb`` MB."""
    if not extra_mb:
        return
    try:
        with open("/proc/self/statm") as f:
            vm_bytes = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:  # no /proc (not Linux): the byte cap and the heap limit still apply
        return
    limit = vm_bytes + int(extra_mb) * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _norm_value(v, float_round: Optional[int]):
    if float_round is not None and isinstance(v, float):
        return round(v, float_round) + 0.0  # + 0.0 folds -0.0 into 0.0
    return v


def compare_results(pred_rows: Sequence[Sequence[Any]], gold_rows: Sequence[Sequence[Any]],
                    compare: str = "set", float_round: Optional[int] = None) -> bool:
    """Execution-accuracy comparison of two result sets.

    ``"set"`` (BIRD): ``set(pred) == set(gold)``; ``"multiset"``: equal as bags of rows;
    ``"ordered"``: equal as lists. Rows are tuples of SQLite values; ``None`` equals ``None``
    and ``1 == 1.0``. ``float_round=d`` rounds floats to ``d`` decimals before comparing.
    """
    p = [tuple(_norm_value(v, float_round) for v in r) for r in pred_rows]
    g = [tuple(_norm_value(v, float_round) for v in r) for r in gold_rows]
    if compare == "set":
        return set(p) == set(g)
    if compare == "multiset":
        return Counter(p) == Counter(g)
    if compare == "ordered":
        return p == g
    raise ValueError(f"compare must be 'set', 'multiset' or 'ordered', got {compare!r}")


def execute_and_compare(db_path: str, pred_sql: str, gold_sql: str, timeout: float = 5.0,
                        max_rows: int = 10_000, compare: str = "set", float_round: Optional[int] = None,
                        heap_limit_mb: Optional[int] = 1024, max_result_mb: Optional[float] = 64) -> Dict[str, Any]:
    """Run predicted and gold SQL on ``db_path`` and compare (runs inside a worker).

    Returns ``{"correct": bool, "reason": str, "pred_rows": int|None, "gold_rows": int|None}``;
    reasons: ``"ok"``, ``"wrong result"``, ``"pred error: ..."``, ``"gold error: ..."``.
    Gold results are cached per worker (every sample of a prompt shares one gold query). The
    two queries share ``timeout``.
    """
    t_end = time.monotonic() + timeout
    pred = run_query(db_path, pred_sql, timeout, max_rows, heap_limit_mb, max_result_mb)
    if not pred["ok"]:
        return {"correct": False, "reason": f"pred error: {pred['error']}", "pred_rows": None, "gold_rows": None}
    key = (os.path.abspath(db_path), gold_sql, max_rows)
    gold = _GOLD_CACHE.get(key)
    if gold is None:
        gold = run_query(db_path, gold_sql, max(0.01, t_end - time.monotonic()), max_rows, heap_limit_mb,
                         max_result_mb)
        if gold["ok"] and len(gold["rows"]) <= _GOLD_CACHE_MAX_ROWS:
            _GOLD_CACHE[key] = gold
            while len(_GOLD_CACHE) > _MAX_GOLD:
                _GOLD_CACHE.popitem(last=False)
    else:
        _GOLD_CACHE.move_to_end(key)
    if not gold["ok"]:
        return {"correct": False, "reason": f"gold error: {gold['error']}", "pred_rows": len(pred["rows"]),
                "gold_rows": None}
    ok = compare_results(pred["rows"], gold["rows"], compare, float_round)
    return {"correct": ok, "reason": "ok" if ok else "wrong result", "pred_rows": len(pred["rows"]),
            "gold_rows": len(gold["rows"])}


# ----------------------------------------------------------------------- parent side
_PRELOAD = ["openrlhf_div.tasks._preload"]  # the same list as the math pool: one fork server serves both


#: after the query deadline: the in-worker alarm fires at +SOFT_S, the parent kills at +HARD_S
_SOFT_S, _HARD_S = 0.25, 0.5


class SQLExecutor:
    """Runs :func:`execute_and_compare` in a shared worker pool under a hard deadline of
    ``timeout + 0.5`` seconds per (pred, gold) pair (the queries stop at ``timeout`` through
    the progress handler; the kill is for hangs in C code)."""

    def __init__(self, timeout: float = 5.0, max_rows: int = 10_000, num_workers: Optional[int] = None,
                 compare: str = "set", float_round: Optional[int] = None, heap_limit_mb: Optional[int] = 1024,
                 max_result_mb: Optional[float] = 64, address_space_mb: Optional[int] = 2048):
        if compare not in ("set", "multiset", "ordered"):
            raise ValueError(f"compare must be 'set', 'multiset' or 'ordered', got {compare!r}")
        if not timeout or timeout <= 0:
            raise ValueError(f"SQLExecutor needs a positive timeout, got {timeout!r}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.timeout = float(timeout)
        self.max_rows = int(max_rows)
        self.num_workers = num_workers
        self.compare = compare
        self.float_round = float_round
        self.heap_limit_mb = heap_limit_mb
        if max_result_mb is not None and max_result_mb <= 0:
            raise ValueError(f"max_result_mb must be > 0 (or None for no cap), got {max_result_mb}")
        self.max_result_mb = max_result_mb
        self.address_space_mb = int(address_space_mb) if address_space_mb else None

    @property
    def pool(self):
        from ._pool import shared_pool

        # one pool per address-space limit: the limit is set once, when a worker starts
        return shared_pool(f"sqlite-sandbox-as{self.address_space_mb or 0}", self.num_workers, preload=_PRELOAD,
                           initializer="openrlhf_div.tasks.sqlite_sandbox:limit_address_space",
                           init_args=(self.address_space_mb,))

    def compare_many(self, jobs: Sequence[Tuple[str, str, str]]) -> List[Dict[str, Any]]:
        """``jobs``: ``(db_path, pred_sql, gold_sql)``. One result dict per job (see
        :func:`execute_and_compare`); a killed or crashed worker gives ``"pred error: timeout"``
        or ``"crash"``."""
        if not jobs:
            return []
        args = [(db, p, g, self.timeout, self.max_rows, self.compare, self.float_round, self.heap_limit_mb,
                 self.max_result_mb) for db, p, g in jobs]
        res = self.pool.run("openrlhf_div.tasks.sqlite_sandbox:execute_and_compare", args,
                            timeout=self.timeout + _SOFT_S, grace=_HARD_S - _SOFT_S)
        out = []
        for r in res:
            if r.ok:
                out.append(r.value)
            else:
                why = "timeout" if r.error == "timeout" else ("worker crashed" if r.error == "crash" else r.error)
                out.append({"correct": False, "reason": f"sandbox: {why}", "pred_rows": None, "gold_rows": None})
        return out
