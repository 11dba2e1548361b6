"""Shared test set-up: test-only helper modules in this directory (``mcore_cpu``) are importable
(the suite runs with ``--import-mode=importlib``, which does not put ``tests/`` on ``sys.path``)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# ------------------------------------------------------------------ parallel runs (pytest-xdist)
# scripts/test.sh runs the suite on 2 workers, a test file at a time per worker (`-n 2 --dist
# loadfile`: a file's module and session fixtures stay on one worker; tests/e2e/test_ray_e2e.py
# is one file so that one worker owns the private Ray head). Each worker gets one OpenMP thread,
# set before any test imports torch (subprocesses inherit it): two workers with two
# spin-waiting threads each on a 2-core machine are many times slower than one thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
