"""Run Megatron-core's model, DDP wrapper and optimizers on CPU (tests and CI only).

megatron-core 0.16 places a few tensors on ``"cuda"`` unconditionally (rotary ``inv_freq``,
the default causal mask, optimizer scalars and scratch buffers) and calls a handful of
``torch.cuda`` functions; otherwise its tensor-parallel layers are device-agnostic and run with
gloo. :func:`megatron_cpu_compat` redirects those calls to the CPU so the same engine code runs
in CPU tests with 1-2 gloo processes:

* a :class:`torch.overrides.TorchFunctionMode` rewrites ``device="cuda[:i]"`` arguments (factory
  functions, ``Tensor.to``) to ``"cpu"`` and makes ``Tensor.cuda()`` a no-op;
* ``torch.cuda.current_device`` returns the CPU device, ``synchronize`` / ``empty_cache`` do
  nothing, ``current_stream`` / ``stream`` return dummies;
* ``Tensor.type()`` reports CPU tensors as ``torch.cuda.*Tensor`` (Megatron's optimizers assert
  parameter types by name);
* the model-parallel CUDA RNG tracker's ``fork()`` becomes a no-op (the configs here use no
  dropout, so no random stream is consumed inside it).

Never used when CUDA is available: on a GPU the engine runs Megatron unmodified.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["megatron_cpu_compat", "is_cpu_compat_active"]

_ACTIVE = [0]


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron checks parameter types by name ("torch.cuda.FloatTensor")
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _DummyStream:
    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def megatron_cpu_compat() -> Iterator[None]:
    """Context in which Megatron-core's CUDA-only corners run on CPU (no-op when CUDA exists)."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel import random as mcore_random

    saved = {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
        "empty_cache": torch.cuda.empty_cache,
        "current_stream": torch.cuda.current_stream,
        "default_stream": torch.cuda.default_stream,
        "stream": torch.cuda.stream,
    }
    saved_fork = mcore_random.CudaRNGStatesTracker.fork
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_stream = lambda *a, **k: _DummyStream()
    torch.cuda.default_stream = lambda *a, **k: _DummyStream()
    torch.cuda.stream = lambda *a, **k: _DummyStream()
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    _ACTIVE[0] += 1
    try:
        with _CudaToCpu():
            yield
    finally:
        _ACTIVE[0] -= 1
        for k, v in saved.items():
            setattr(torch.cuda, k, v)
        mcore_random.CudaRNGStatesTracker.fork = saved_fork


def is_cpu_compat_active() -> bool:
    return _ACTIVE[0] > 0
