"""Run a function in N local processes joined by a gloo process group (CPU tests and checks).

``run_multiprocess(fn, world_size=2)`` forks ``world_size`` processes, initialises
``torch.distributed`` with the gloo backend on a free local port, calls ``fn(rank, world_size,
*args)`` in each and returns the per-rank return values (picklable) in rank order. A child that
raises fails the call with its traceback; a child that hangs is killed after ``timeout`` seconds.
Fork (not spawn) keeps start-up fast: children inherit the parent's imported modules.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as _queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Sequence

__all__ = ["free_port", "run_multiprocess"]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, args, q, timeout):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
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


def run_multiprocess(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (),
                     timeout: float = 60.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo-connected processes."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, tuple(args), q, timeout), daemon=False)
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
