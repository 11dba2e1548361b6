"""Loaded by every Python process that has this folder on ``PYTHONPATH`` (a CPU run's Ray
workers and vLLM's engine-core process: :func:`openrlhf_div.compat.cpu_seams.worker_env`).
Does nothing unless ``OPENRLHF_DIV_CPU_SEAMS=1``.

Installs the import hooks of :mod:`openrlhf_div.compat.cpu_seams` (OpenRLHF's CUDA-only calls ->
CPU). Imports neither torch nor OpenRLHF here: each patch runs when its upstream module is first
imported.
"""
import os
import sys

if os.environ.get("OPENRLHF_DIV_CPU_SEAMS") == "1":
    _here = os.path.dirname(os.path.abspath(__file__))
    _root = os.path.dirname(os.path.dirname(os.path.dirname(_here)))
    try:
        from openrlhf_div.compat import cpu_seams
    except ImportError:  # the package is not installed: it is the checkout this folder is in
        sys.path.append(_root)
        from openrlhf_div.compat import cpu_seams

    cpu_seams.install_import_hooks()
