"""Crash-safe file writes shared by every stage: write a temporary sibling, flush and fsync
it, then ``os.replace`` it over the target, so a reader (or a resumed run) sees either the
old file or the new one, never half of one. Standard library only."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Iterable, Mapping, Union


def atomic_write_bytes(path: str, data: Union[bytes, str], encoding: str = "utf-8") -> None:
    """Write ``data`` (bytes, or text encoded with ``encoding``) to ``path`` atomically,
    creating the parent folder if needed."""
    if isinstance(data, str):
        data = data.encode(encoding)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text)


def atomic_write_json(path: str, obj: Any, **dump_kwargs) -> None:
    """``json.dumps(obj, **dump_kwargs)`` (default ``indent=2``) plus a newline, atomically."""
    dump_kwargs.setdefault("indent", 2)
    atomic_write_bytes(path, json.dumps(obj, **dump_kwargs) + "\n")


def atomic_write_jsonl(path: str, rows: Iterable[Mapping[str, Any]], **dump_kwargs) -> None:
    """One JSON object a line, atomically."""
    dump_kwargs.setdefault("ensure_ascii", False)
    atomic_write_bytes(path, "".join(json.dumps(r, **dump_kwargs) + "\n" for r in rows))
