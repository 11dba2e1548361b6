#!/usr/bin/env python
"""Build the tiny SQLite fixture databases from SQL text kept in the repository.

Every ``<db_id>.sql`` in ``--src`` becomes ``<out>/<db_id>/<db_id>.sqlite`` (the BIRD/Spider
layout the ``sql`` task reads with ``db_root=<out>``). No binary files are committed: tests call
:func:`build_databases` into a temporary folder.

    python tests/tools/make_fixture_db.py --out /tmp/dbs   # --src defaults to examples/data/toy_sql/dbs
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
from typing import Dict

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SRC = os.path.join(HERE, "..", "..", "examples", "data", "toy_sql", "dbs")


def build_database(sql_path: str, out_root: str) -> str:
    """Create ``out_root/<db_id>/<db_id>.sqlite`` from ``sql_path`` atomically; return its path."""
    db_id = os.path.splitext(os.path.basename(sql_path))[0]
    with open(sql_path, encoding="utf-8") as fh:
        script = fh.read()
    folder = os.path.join(out_root, db_id)
    os.makedirs(folder, exist_ok=True)
    final = os.path.join(folder, f"{db_id}.sqlite")
    fd, tmp = tempfile.mkstemp(suffix=".sqlite", dir=folder)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        try:
            conn.executescript(script)
            conn.commit()
        finally:
            conn.close()
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return final


def build_databases(out_root: str, src: str = DEFAULT_SRC) -> Dict[str, str]:
    """Build every ``*.sql`` in ``src``; returns ``{db_id: path}``."""
    sqls = sorted(f for f in os.listdir(src) if f.endswith(".sql"))
    if not sqls:
        raise FileNotFoundError(f"no .sql files in {src}")
    return {os.path.splitext(f)[0]: build_database(os.path.join(src, f), out_root) for f in sqls}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=DEFAULT_SRC, help="folder of <db_id>.sql files")
    ap.add_argument("--out", required=True, help="db_root to create (<out>/<db_id>/<db_id>.sqlite)")
    args = ap.parse_args(argv)
    for db_id, path in build_databases(args.out, args.src).items():
        print(f"{db_id}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
