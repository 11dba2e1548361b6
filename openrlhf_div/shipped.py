"""The files the package ships besides its code: experiment files, toy data, the Ray launcher.

A checkout keeps them at its top level (``configs/``, ``examples/data/``, ``examples/scripts/``);
a built wheel carries the same tree under ``openrlhf_div/_shipped/`` (``setup.py`` copies
:data:`SHIPPED` there). :func:`root` is the folder that holds them, laid out as in the checkout,
so a path written relative to the repository in a config (``examples/data/toy_math/train.jsonl``)
means the same file in both. Nothing in the package reads ``tests/``.

No imports beyond ``os``: ``setup.py`` reads :data:`SHIPPED` from this file.
"""
from __future__ import annotations

import os

#: folders (relative to the repository's root) that the wheel carries under ``openrlhf_div/_shipped``
SHIPPED = ("configs", "examples/data", "examples/scripts")

#: the installed copy's folder inside the package
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shipped")

#: the checkout this package's code sits in (an editable install or a clone on ``sys.path``)
CHECKOUT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _holds_ours(folder: str) -> bool:
    """``folder`` has this project's tree (not just any ``configs/``: an installed package's parent
    is site-packages, where another distribution may have put a top-level ``configs``)."""
    return (os.path.isdir(os.path.join(folder, "configs", "openrlhf"))
            and os.path.isfile(os.path.join(folder, "examples", "scripts", "run.sh")))


def root(strict: bool = True) -> str:
    """The folder holding ``configs/`` and ``examples/``: the checkout's top level when the package
    runs from one, else the wheel's ``openrlhf_div/_shipped``. Neither: an error naming both
    (``strict=False``: the checkout's path, for module-level constants that must not raise)."""
    for candidate in (CHECKOUT_DIR, PACKAGE_DIR):
        if _holds_ours(candidate):
            return candidate
    if not strict:
        return CHECKOUT_DIR
    raise FileNotFoundError(
        f"openrlhf-div's shipped files (configs/, examples/) are neither in a checkout ({CHECKOUT_DIR}) nor in "
        f"the installed package ({PACKAGE_DIR}); reinstall the package from its wheel or a clone, or pass a "
        "config file's path")


def path(*parts: str) -> str:
    """``os.path.join(root(), *parts)``: a shipped file by its path in the repository."""
    return os.path.join(root(), *parts)
