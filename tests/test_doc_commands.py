"""Issue 43 item 6: the command blocks of README.md and docs/ marked runnable on a CPU are run.

A fenced block right after ``<!-- cpu-runnable -->`` runs as it is written (a bash script, every
command must exit 0); after ``<!-- cpu-runnable: dry-run -->`` each command gets ``--dry-run``
appended (for commands whose real run takes minutes: ``openrlhf-div run``, the Ray launcher).
Each block runs in a scratch copy of the checkout (symbolic links to its files, a fresh ``runs/``),
with the test's Python environment first on PATH (so ``openrlhf-div`` is this checkout's).
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from typing import List, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = re.compile(r"^<!--\s*cpu-runnable(?::\s*(dry-run))?\s*-->\s*$")


def marked_blocks() -> List[Tuple[str, int, str, bool]]:
    """``(file, line, script, dry_run)`` of every marked block."""
    out = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        lines = open(path, encoding="utf-8").read().splitlines()
        for i, line in enumerate(lines):
            m = MARK.match(line.strip())
            if not m:
                continue
            assert i + 1 < len(lines) and lines[i + 1].startswith("```"), \
                f"{os.path.relpath(path, ROOT)}:{i + 1}: a cpu-runnable marker must stand right before a ``` block"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            out.append((os.path.relpath(path, ROOT), i + 1, "\n".join(lines[i + 2:end]), bool(m.group(1))))
    return out


def commands(script: str) -> List[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    out, cur = [], ""
    for raw in script.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        text = re.sub(r"\s+#.*$", "", cur).strip()
        cur = ""
        if text and not text.startswith("#"):
            out.append(text)
    return out


def scratch_checkout(tmp) -> str:
    """Symbolic links to every top-level entry of the checkout except runs/: commands that write
    runs/... write into ``tmp``; the package and scripts resolve to this checkout's."""
    for name in os.listdir(ROOT):
        if name not in ("runs", ".git"):
            os.symlink(os.path.join(ROOT, name), os.path.join(tmp, name))
    return str(tmp)


BLOCKS = marked_blocks()


def test_the_docs_mark_runnable_blocks():
    """The markers exist (a rename of the marker would otherwise leave this test running nothing)."""
    assert len(BLOCKS) >= 2 and any(b[3] for b in BLOCKS) and any(not b[3] for b in BLOCKS), BLOCKS


@pytest.mark.parametrize("where,line,script,dry", BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in BLOCKS])
def test_a_marked_block_runs(where, line, script, dry, tmp_path):
    cwd = scratch_checkout(tmp_path)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONUTF8="1", PYTHON=sys.executable)
    for var in ("RUN_DIR", "DATA_DIR", "PRESAMPLE_DIR", "TINY_MODEL"):
        env.pop(var, None)
    for cmd in commands(script):
        run = cmd + (" --dry-run" if dry else "")
        r = subprocess.run(["bash", "-c", run], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{where}:{line}: `{run}` exited {r.returncode}:\n{r.stderr[-3000:]}"
