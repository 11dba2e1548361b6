"""Shared test set-up: test-only helper modules in this directory (``mcore_cpu``) are importable
(the suite runs with ``--import-mode=importlib``, which does not put ``tests/`` on ``sys.path``)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
