"""Loaded by every Python process of the CPU end-to-end test cluster (this folder is on the Ray
head's ``PYTHONPATH``; workers inherit it). Does nothing unless ``OPENRLHF_DIV_CPU_SEAMS=1``.

Installs the import hooks of :mod:`cpu_seams` (OpenRLHF's CUDA-only calls -> CPU) and, when
``OPENRLHF_DIV_E2E_PROBE=1``, of :mod:`e2e_probe` (test instrumentation), and the fault
corpus's injections (:mod:`e2e_faults`, each off unless its variable is set). None imports
torch or OpenRLHF here: each patch runs when its upstream module is first imported.
"""
import os

if os.environ.get("OPENRLHF_DIV_CPU_SEAMS") == "1":
    import cpu_seams

    cpu_seams.install_import_hooks()
    if os.environ.get("OPENRLHF_DIV_E2E_PROBE") == "1":
        import e2e_probe

        e2e_probe.install()
    import e2e_faults  # the fault corpus's injections: each off unless its variable is set

    e2e_faults.install()
