"""Imported once by the verifier pools' fork server (``multiprocessing`` ``forkserver``
preload): it imports the verifier modules and warms math-verify (its LaTeX grammar and sympy
caches) so that every worker forked from the server -- including replacements for killed
ones -- starts warm in milliseconds instead of spending a second on its first check."""
import sqlite3  # noqa: F401

from openrlhf_div.tasks import _pool, sqlite_sandbox  # noqa: F401
from openrlhf_div.tasks import math as _math

try:
    _math.warmup()
except Exception:  # noqa: BLE001 - math-verify missing or broken: workers report it per check
    pass
