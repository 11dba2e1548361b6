"""Holds the ``sitecustomize.py`` of CPU runs (see :mod:`openrlhf_div.compat.cpu_seams`); not imported."""
