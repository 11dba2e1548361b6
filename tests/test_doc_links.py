"""Every documentation page the package's docstrings and messages name exists (issue 30: the
registry's docstring sent readers to an ARCHITECTURE.md the repository does not have). A page is
named as ``docs/NAME.md`` or as a bare upper-case ``NAME.md`` (README.md, ALGORITHMS.md): it must be
in the repository root or in docs/. Lower-case bare names (results.md, report.md) are files the
tools write, not pages."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)\b")


def test_named_pages_exist():
    missing = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "openrlhf_div")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            text = open(path, encoding="utf-8").read()
            for m in PAGE.finditer(text):
                name = m.group(1)
                base = os.path.basename(name)
                if not name.startswith("docs/") and not base[:1].isupper():
                    continue
                if not (os.path.exists(os.path.join(ROOT, name)) or os.path.exists(os.path.join(ROOT, "docs", base))):
                    line = text[:m.start()].count("\n") + 1
                    missing.append(f"{os.path.relpath(path, ROOT)}:{line}: {name}")
    assert not missing, "pages named but not in the repository:\n" + "\n".join(missing)
