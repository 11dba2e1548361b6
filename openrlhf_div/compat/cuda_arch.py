"""``TORCH_CUDA_ARCH_LIST`` in a form DeepSpeed's JIT op builder can parse.

CUDA images for Hopper / Blackwell set architecture-specific entries such as ``9.0a`` (or ``10.0a``,
``12.0f``). PyTorch's ``cpp_extension`` accepts them; DeepSpeed 0.19's ``compute_capability_args``
parses every entry's minor version with ``int()`` and fails on ``0a`` (``ValueError: invalid literal
for int() with base 10: '0a'``; DeepSpeed issue 7589), so FusedAdam (and every other JIT-built op)
never builds on such an image: the first GPU run found it on an H200 (docs/benchmarks.md, "GPU
figures"). :func:`deepspeed_arch_list` drops the suffix of such entries (``9.0a`` -> ``9.0``,
``9.0a+PTX`` -> ``9.0+PTX``) and keeps every other entry as it is; :func:`fix_arch_env` applies it
to an environment with one printed line saying what was changed and why. Every process of ours that
may JIT-build a DeepSpeed op gets it: the Ray workers (through the runtime env,
``engines/openrlhf/jobs.py: task_env``), the local engine's and the Megatron engine's process, and
the GPU bench's driver (its case processes inherit it).

Stdlib only: imported by every process of a Ray run.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Mapping, MutableMapping, Optional, Tuple

VAR = "TORCH_CUDA_ARCH_LIST"

_ENTRY = re.compile(r"^(\d+)\.(\d+)([A-Za-z]+)(\+PTX)?$")


def deepspeed_arch_list(value: str) -> Tuple[str, bool]:
    """``(value DeepSpeed can parse, whether anything changed)``: ``X.Ya`` / ``X.Yf`` entries become
    ``X.Y`` (``+PTX`` kept), duplicates that creates are dropped, other entries are kept as they are
    (separators: ``;`` or whitespace, as DeepSpeed and PyTorch read them)."""
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    out, changed = [], False
    for e in entries:
        m = _ENTRY.match(e)
        if m:
            e = f"{m.group(1)}.{m.group(2)}{m.group(4) or ''}"
            changed = True
        if e not in out:
            out.append(e)
    return ";".join(out), changed


_ANNOUNCED: set = set()


def _announce(old: str, new: str, who: str, stream) -> None:
    if (old, new) in _ANNOUNCED:   # one line per process, however often a runtime env is built
        return
    _ANNOUNCED.add((old, new))
    print(f"[{who}] {VAR}={old!r} -> {new!r}: DeepSpeed's JIT op builder (FusedAdam) cannot parse "
          "architecture-suffixed entries such as '9.0a' (DeepSpeed issue 7589); the same GPUs are targeted",
          file=stream or sys.stderr, flush=True)


def parseable_arch_value(environ: Mapping[str, str], who: str = "openrlhf-div", stream=None) -> Optional[str]:
    """The ``TORCH_CUDA_ARCH_LIST`` a process started from ``environ`` should get (a Ray worker's
    runtime env): :func:`deepspeed_arch_list` of ``environ``'s value (said once per process when it
    changes it), or ``None`` when ``environ`` has none."""
    old = environ.get(VAR)
    if not old:
        return None
    new, changed = deepspeed_arch_list(old)
    if changed and new != old:
        _announce(old, new, who, stream)
        return new
    return old


def fix_arch_env(environ: Optional[MutableMapping[str, str]] = None, who: str = "openrlhf-div",
                 stream=None) -> Optional[str]:
    """Rewrite ``environ[TORCH_CUDA_ARCH_LIST]`` (default ``os.environ``) with
    :func:`deepspeed_arch_list` when it needs it, printing one line to ``stream`` (stderr); returns
    the new value, or ``None`` when nothing changed (unset or already parseable)."""
    environ = os.environ if environ is None else environ
    old = environ.get(VAR)
    if not old:
        return None
    new, changed = deepspeed_arch_list(old)
    if not changed or new == old:
        return None
    environ[VAR] = new
    _announce(old, new, who, stream)
    return new
