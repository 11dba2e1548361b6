"""Rebinding a third-party module attribute for the duration of one call (standard library only).

The Ray-side classes of the OpenRLHF engine build OpenRLHF's own objects with ours in their
place (its ``ActorPPOTrainer`` and ``Actor`` in the policy actor, its ``Actor`` in the reference
actor) by rebinding the name OpenRLHF looks up, inside the actor's own process, only while that
call runs: nothing leaks into other actors or later calls.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    """Temporarily rebind ``module.name`` to ``value`` (restored even on error)."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)
