"""megatron-core on CPU: the CUDA-to-CPU shim and N gloo processes.

The production engine (``openrlhf_div.engines.megatron``) runs megatron-core unmodified; on a
machine without a GPU the CPU path (:mod:`openrlhf_div.compat.cpu_seams`) and the CPU tests
enter :func:`megatron_cpu_compat` around it. It lives in the package (not under ``tests/``) because
the CPU Ray path runs it in every Megatron actor: an installed package must not need the checkout.

**The shim.** Run Megatron-core's model, DDP wrapper and optimizers on CPU (tests and CI only).

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

Never active when CUDA is available.

**The processes.** ``run_multiprocess(fn, world_size=2)`` forks ``world_size`` processes,
initialises ``torch.distributed`` with the gloo backend on a free local port, calls
``fn(rank, world_size, *args)`` in each (inside :func:`megatron_cpu_compat`) and returns the
per-rank return values (picklable) in rank order. A child that raises fails the call with its
traceback; a child that hangs is killed after ``timeout`` seconds. Fork (not spawn) keeps
start-up fast: children inherit the parent's imported modules.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import multiprocessing as mp
import os
import queue as _queue
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, List, Sequence

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["megatron_cpu_compat", "is_cpu_compat_active", "free_port", "run_multiprocess"]

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


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_fn(ref):
    """The function ``ref = (file, qualname)`` names, from its file: test modules are imported by
    pytest in its importlib import mode and cannot be imported by name in a fresh process."""
    import importlib.util

    path, qualname = ref
    mod_name = "_mp_" + os.path.splitext(os.path.basename(path))[0]
    mod = sys.modules.get(mod_name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _child(fn_ref, rank, world_size, port, args, q, timeout):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        fn = _load_fn(fn_ref)
        with megatron_cpu_compat():
            out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # by value: torch's queue pickler would pass tensors by file descriptor
        q.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # pragma: no cover
            pass


def _mp_context():
    """Children come from a fork server: a fresh single-threaded process (started once per test
    process, torch and megatron-core preloaded), never from the test process itself. Forking a
    pytest-xdist worker directly (it runs execnet's I/O thread, and earlier tests may have left
    threads of their own) hung both children of a gloo pair in a clean-clone run."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron.core", __name__])
    return ctx


def run_multiprocess(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (),
                     timeout: float = 60.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo-connected processes."""
    ctx = _mp_context()
    q = ctx.Queue()
    port = free_port()
    fn_ref = (os.path.abspath(inspect.getsourcefile(fn)), fn.__qualname__)
    procs = [ctx.Process(target=_child, args=(fn_ref, r, world_size, port, tuple(args), q, timeout), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict = {}
    errors: List[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, out = q.get(timeout=timeout)
            except _queue.Empty:
                errors.append(f"timed out after {timeout:.0f}s waiting for {world_size - len(results)} process(es)")
                break
            if ok:
                import torch

                results[rank] = torch.load(io.BytesIO(out), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{out}")
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise RuntimeError("run_multiprocess: " + "\n".join(errors))
    return [results[r] for r in range(world_size)]
