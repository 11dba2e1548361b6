"""Loaded by every Python process that has this folder on ``PYTHONPATH`` (a CPU run's Ray
workers and vLLM's engine-core process: :func:`openrlhf_div.compat.cpu_seams.worker_env`).
Does nothing unless ``OPENRLHF_DIV_CPU_SEAMS=1``.

Installs the import hooks of :mod:`openrlhf_div.compat.cpu_seams` (OpenRLHF's CUDA-only calls ->
CPU). Imports neither torch nor OpenRLHF here: each patch runs when its upstream module is first
imported. ``OPENRLHF_DIV_SITE_HOOKS=/path/a.py,...`` (test instrumentation: the e2e probe) imports
those files too, each as the module of its file name, in every such process.
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
    for _path in [p for p in os.environ.get("OPENRLHF_DIV_SITE_HOOKS", "").split(",") if p]:
        import importlib.util

        _name = os.path.splitext(os.path.basename(_path))[0]
        if _name not in sys.modules:
            _spec = importlib.util.spec_from_file_location(_name, _path)
            _mod = importlib.util.module_from_spec(_spec)
            sys.modules[_name] = _mod
            _spec.loader.exec_module(_mod)
