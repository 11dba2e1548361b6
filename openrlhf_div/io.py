"""Crash-safe file writes shared by every stage: write a temporary sibling, flush and fsync
it, then ``os.replace`` it over the target, so a reader (or a resumed run) sees either the
old file or the new one, never half of one. Standard library only.

Files and folders made here follow the umask like ``open()`` / ``os.makedirs`` do (0644 / 0755
under umask 0022): ``mkstemp`` / ``mkdtemp`` create them owner-only (0600 / 0700), which
:func:`apply_umask_mode` undoes before the rename, so teammates and a serving account can read
results, configs and checkpoints."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Iterable, Mapping, Union


def current_umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask_mode(path: str, directory: bool = False) -> None:
    """``chmod`` ``path`` to what a plain ``open`` (0666) or ``mkdir`` (0777) would give under
    the current umask."""
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


def apply_umask_modes_tree(root: str) -> None:
    """:func:`apply_umask_mode` on ``root`` and everything under it (a folder filled by a library
    that writes through its own temporary files, like ``save_pretrained``'s 0600 safetensors)."""
    apply_umask_mode(root, directory=True)
    for d, dirs, files in os.walk(root):
        for name in dirs:
            apply_umask_mode(os.path.join(d, name), directory=True)
        for name in files:
            p = os.path.join(d, name)
            if not os.path.islink(p):
                apply_umask_mode(p)


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
        apply_umask_mode(tmp)
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
