"""A small process pool with a *hard* wall-clock limit per job and restart on crash.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot stop one running job. A verifier
job can hang inside C code (``10^{10^{10}}`` makes sympy compute a huge integer power; a
SQLite query can allocate without end), where no Python signal handler ever runs. Here each
job runs in a worker process; when a job passes its deadline the parent kills that worker
(SIGKILL) and starts a fresh one, and a worker that dies (segfault, OOM kill) is replaced the
same way. Either way the job's result says why (``"timeout"``, ``"crash"``) and the caller
scores it 0 -- the trainer never waits longer than the deadline and never dies with a worker.

The pool is safe to call from several threads at once (OpenRLHF calls ``reward_func`` through
``asyncio.to_thread``): every call checks idle workers out of a shared queue, runs its jobs
on them, and puts them back.

Jobs name their function as ``"package.module:function"`` so nothing but plain data crosses
the pipe. Workers are started from a ``forkserver`` (safe in processes that hold threads or
CUDA state, unlike ``fork``) that preloads the verifier modules, so a restart costs
milliseconds, not a fresh interpreter. Set ``OPENRLHF_DIV_MP_CONTEXT`` (``fork``,
``forkserver``, ``spawn``) to choose another start method.

Workers never import the caller's main script. A plain ``multiprocessing`` ``spawn`` or
``forkserver`` child re-imports ``__main__`` (as ``__mp_main__``), so a script without an
``if __name__ == "__main__":`` guard would run its top level again in every worker (and a
training script would start training there). The jobs here name importable functions, so the
workers have no use for ``__main__``: the pool starts them with the main-module entries removed
from multiprocessing's preparation data (only for its own workers, on the starting thread).

A job whose worker died (``"crash"``) is run once more on a fresh worker before it is reported;
a timed-out job is not retried (it would only time out again). A job may ask for its worker to
be replaced after it returns (:func:`request_recycle`: the SQL sandbox does so after a result
that hit its memory cap, so the memory goes back to the OS).
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing import spawn as _mp_spawn
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["JobResult", "WorkerPool", "WorkerStartError", "SoftTimeout", "soft_time_limit", "shared_pool",
           "request_recycle"]

# ------------------------------------------------------------------ workers without __main__
_NO_MAIN = threading.local()
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")


def _install_no_main_hook() -> None:
    """Wrap ``multiprocessing.spawn.get_preparation_data`` (what ``spawn`` and ``forkserver``
    children run ``prepare()`` on) so that, while *this* thread starts one of our workers, the
    entries that make the child import ``__main__`` are left out. Other threads and other
    libraries' processes are untouched."""
    orig = _mp_spawn.get_preparation_data
    if getattr(orig, "_openrlhf_div_no_main", False):
        return

    def get_preparation_data(name):
        d = orig(name)
        if getattr(_NO_MAIN, "active", False):
            for k in _MAIN_KEYS:
                d.pop(k, None)
        return d

    get_preparation_data._openrlhf_div_no_main = True  # type: ignore[attr-defined]
    _mp_spawn.get_preparation_data = get_preparation_data


_install_no_main_hook()

_RECYCLE = False


def request_recycle() -> None:
    """Called from inside a job: replace this worker after the job's result is sent."""
    global _RECYCLE
    _RECYCLE = True


class WorkerStartError(RuntimeError):
    """A worker could not start (its initializer failed or it never said it was ready)."""


class SoftTimeout(BaseException):
    """Raised inside a worker when a job's soft (signal-based) time limit fires. A
    ``BaseException`` so that libraries' broad ``except Exception`` cannot swallow it."""


@dataclass
class JobResult:
    """``ok``: the function returned ``value``. Otherwise ``error`` is ``"timeout"`` (soft or
    hard limit), ``"crash"`` (the worker died) or ``"ExcType: message"`` (the job raised)."""

    ok: bool
    value: Any = None
    error: str = ""


class soft_time_limit:
    """Context manager: raise :class:`SoftTimeout` after ``seconds`` of wall time.

    Uses ``SIGALRM``/``setitimer``, so it works only in a process's main thread and cannot
    interrupt a long C call; the pool's hard kill is the backstop for those. Elsewhere (or
    with ``seconds`` <= 0) it does nothing.
    """

    def __init__(self, seconds: Optional[float]):
        self.seconds = seconds
        self._armed = False

    def __enter__(self):
        if (self.seconds and self.seconds > 0 and hasattr(signal, "setitimer")
                and threading.current_thread() is threading.main_thread()):
            def _raise(signum, frame):
                raise SoftTimeout(f"soft time limit of {self.seconds:g}s hit")

            self._old = signal.signal(signal.SIGALRM, _raise)
            signal.setitimer(signal.ITIMER_REAL, float(self.seconds))
            self._armed = True
        return self

    def __exit__(self, *exc):
        if self._armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)
        return False


def _resolve(path: str) -> Callable:
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def _worker_main(conn, initializer: Optional[str], init_args: tuple) -> None:  # pragma: no cover - runs in a child
    """Worker loop: receive ``(func_path, args, soft_timeout)``, reply ``(status, payload)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    try:
        if initializer:
            _resolve(initializer)(*init_args)
    except BaseException as exc:  # noqa: BLE001
        conn.send(("init-error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))  # the parent starts a job's clock only after this
    cache: Dict[str, Callable] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        func_path, args, soft = msg
        global _RECYCLE
        _RECYCLE = False
        try:
            fn = cache.get(func_path)
            if fn is None:
                fn = cache[func_path] = _resolve(func_path)
            with soft_time_limit(soft):
                value = fn(*args)
            reply = ("ok", value, _RECYCLE)
        except SoftTimeout:
            reply = ("timeout", None, _RECYCLE)
        except BaseException as exc:  # noqa: BLE001 - report, never die on a job's error
            reply = ("err", f"{type(exc).__name__}: {str(exc)[:500]}", _RECYCLE)
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result: say so instead of dying
            conn.send(("err", f"result could not be sent back: {type(exc).__name__}: {exc}", _RECYCLE))


class _Worker:
    def __init__(self, pool: "WorkerPool"):
        self.pool = pool
        self.proc = None
        self.conn = None

    def ensure_started(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            return
        self.discard()
        parent, child = self.pool._ctx.Pipe(duplex=True)
        proc = self.pool._ctx.Process(target=_worker_main, args=(child, self.pool.initializer, self.pool.init_args),
                                      daemon=True, name=f"{self.pool.name}-worker")
        _NO_MAIN.active = True
        try:
            proc.start()
        finally:
            _NO_MAIN.active = False
        child.close()
        self.proc, self.conn = proc, parent
        self.pool.starts += 1
        # wait for the worker's imports/initializer so they never eat into a job's deadline
        if not parent.poll(self.pool.startup_timeout):
            self.discard()
            raise WorkerStartError(f"{self.pool.name}: worker did not start within {self.pool.startup_timeout:g}s")
        try:
            status, payload = parent.recv()[:2]
        except (EOFError, OSError):
            status, payload = "init-error", "the worker exited during start-up"
        if status != "ready":
            self.discard()
            raise WorkerStartError(f"{self.pool.name}: worker initializer failed: {payload}")

    def discard(self) -> None:
        """Kill the process (if any) and forget it; the next job starts a fresh one."""
        if self.proc is not None:
            try:
                if self.proc.is_alive():
                    self.proc.kill()
                self.proc.join(timeout=5)
            except Exception:  # noqa: BLE001
                pass
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # noqa: BLE001
                pass
        self.proc, self.conn = None, None


_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


class WorkerPool:
    """``num_workers`` worker processes running jobs under a hard per-job deadline.

    ``run(func, args_list, timeout)`` runs ``func(*args)`` for every ``args`` in
    ``args_list`` (in parallel over the workers) and returns one :class:`JobResult` per job,
    in order. Inside the worker a soft limit (``SIGALRM``) of ``timeout`` seconds stops
    pure-Python work cheaply; the parent kills the worker at ``timeout + grace`` seconds.
    Workers start lazily on first use.
    """

    def __init__(self, num_workers: Optional[int] = None, *, initializer: Optional[str] = None,
                 init_args: tuple = (), preload: Sequence[str] = (), context: Optional[str] = None,
                 name: str = "openrlhf-div", startup_timeout: float = 120.0):
        if num_workers is None:
            num_workers = min(4, os.cpu_count() or 1)
        if num_workers < 1:
            raise ValueError(f"WorkerPool needs num_workers >= 1, got {num_workers}")
        if context is None:
            context = os.environ.get("OPENRLHF_DIV_MP_CONTEXT") or (
                "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        if context not in mp.get_all_start_methods():
            raise ValueError(f"multiprocessing start method {context!r} is not available here; "
                             f"choose one of {mp.get_all_start_methods()}")
        self._ctx = mp.get_context(context)
        if context == "forkserver" and preload:
            # Only takes effect if the fork server has not started yet; harmless otherwise.
            self._ctx.set_forkserver_preload(list(preload))
        self.num_workers = num_workers
        self.initializer = initializer
        self.init_args = tuple(init_args)
        self.name = name
        self.startup_timeout = float(startup_timeout)
        self.starts = 0  # worker processes started so far (restarts included); for tests/logs
        self.kills = 0   # workers killed for a hard timeout, found dead, or recycled on request
        self.retries = 0  # jobs run again after their worker crashed
        self._idle: "queue.Queue[_Worker]" = queue.Queue()
        self._all = [_Worker(self) for _ in range(num_workers)]
        for w in self._all:
            self._idle.put(w)
        self._closed = False
        _LIVE_POOLS.add(self)

    # ------------------------------------------------------------------ public API
    def run(self, func: str, args_list: Sequence[tuple], timeout: float, grace: float = 1.0) -> List[JobResult]:
        """Run ``func(*args)`` for each ``args`` with a hard limit of ``timeout + grace`` s.
        A job whose worker crashed is run once more (on a fresh worker) before it is reported."""
        if self._closed:
            raise RuntimeError(f"WorkerPool {self.name!r} is closed")
        n = len(args_list)
        results: List[Optional[JobResult]] = [None] * n
        pending = deque(range(n))
        tried = [0] * n
        active: Dict[Any, Tuple[_Worker, int, float]] = {}  # conn -> (worker, job index, deadline)
        held: List[_Worker] = []

        def crashed(idx: int) -> None:
            if tried[idx] < 2:
                self.retries += 1
                pending.appendleft(idx)
            else:
                results[idx] = JobResult(False, None, "crash")

        try:
            while pending or active:
                # hand out jobs: block for the first worker only when we hold none busy
                while pending:
                    try:
                        w = self._idle.get(block=not active, timeout=None)
                    except queue.Empty:
                        break
                    held.append(w)
                    idx = pending.popleft()
                    tried[idx] += 1
                    if not self._send(w, func, args_list[idx], timeout):
                        results[idx] = JobResult(False, None, "crash")
                        self._release(w, held)
                        continue
                    active[w.conn] = (w, idx, time.monotonic() + timeout + grace)
                if not active:
                    continue
                now = time.monotonic()
                wait_s = max(0.0, min(d for _, _, d in active.values()) - now)
                ready = _mp_wait(list(active), timeout=wait_s)
                for conn in ready:
                    w, idx, _ = active.pop(conn)
                    try:
                        status, payload, recycle = conn.recv()
                    except (EOFError, OSError):
                        status, payload, recycle = "crash", None, False
                        self.kills += 1
                        w.discard()
                    if recycle:  # the job asked for a fresh worker (e.g. after a memory cap hit)
                        self.kills += 1
                        w.discard()
                    if status == "ok":
                        results[idx] = JobResult(True, payload, "")
                    elif status == "timeout":
                        results[idx] = JobResult(False, None, "timeout")
                    elif status == "crash":
                        crashed(idx)
                    else:
                        results[idx] = JobResult(False, None, str(payload))
                    self._release(w, held)
                now = time.monotonic()
                for conn, (w, idx, deadline) in list(active.items()):
                    if now >= deadline:
                        del active[conn]
                        self.kills += 1
                        w.discard()  # hung (likely in C code): kill it, a fresh one starts on demand
                        results[idx] = JobResult(False, None, "timeout")
                        self._release(w, held)
        finally:
            # an exception (e.g. KeyboardInterrupt) mid-batch: busy workers hold stale jobs
            for conn, (w, _, _) in active.items():
                w.discard()
            for w in held:
                self._idle.put(w)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop every worker. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for w in self._all:
            if w.conn is not None:
                try:
                    w.conn.send(None)
                except Exception:  # noqa: BLE001
                    pass
            w.discard()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ internals
    def _send(self, w: _Worker, func: str, args: tuple, timeout: float) -> bool:
        for _attempt in range(2):  # a worker that died while idle gets one replacement
            try:
                w.ensure_started()
                w.conn.send((func, tuple(args), timeout))
                return True
            except (BrokenPipeError, EOFError, OSError):
                self.kills += 1
                w.discard()
        return False

    def _release(self, w: _Worker, held: List[_Worker]) -> None:
        held.remove(w)
        self._idle.put(w)


@atexit.register
def _close_all_pools() -> None:  # pragma: no cover - interpreter shutdown
    for p in list(_LIVE_POOLS):
        try:
            p.close()
        except Exception:  # noqa: BLE001
            pass


_SHARED: Dict[tuple, WorkerPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(key: str, num_workers: Optional[int] = None, **kwargs) -> WorkerPool:
    """One pool per ``(key, num_workers)`` per process, so many task objects share workers."""
    k = (key, num_workers)
    with _SHARED_LOCK:
        pool = _SHARED.get(k)
        if pool is None or pool._closed:
            pool = _SHARED[k] = WorkerPool(num_workers, name=key, **kwargs)
        return pool
