"""CPU-only patches that let OpenRLHF 0.11.2's Ray topology run on a machine without CUDA.

Applied by the package whenever no GPU is present (:func:`cpu_mode`): the Ray drivers
(:mod:`openrlhf_div.engines.openrlhf.launch`, ``presample_ray``) install the hooks in their own
process and hand every Ray worker :func:`worker_env` (``OPENRLHF_DIV_CPU_SEAMS=1`` and the
package's ``cpu_site`` folder on ``PYTHONPATH``); that folder's ``sitecustomize.py`` calls
:func:`install_import_hooks` in every Python process of the run (the job driver, every Ray
worker, vLLM's engine-core process). Each patch is applied when its upstream module is first
imported, so processes that never import OpenRLHF pay nothing. On a machine with a GPU none of
this is applied (``OPENRLHF_DIV_CPU_SEAMS=0`` forces it off, ``=1`` on).

Every patched seam is one place where OpenRLHF calls a CUDA-only API on the path
``train() -> vLLM rollout -> DeepSpeed actor step -> weight sync -> checkpoint``. The list
(with upstream file:line) is in docs/scaling.md, "CUDA-only seams"; it is what a GPU run must
still prove. Keep the two in step: :data:`SEAMS` names each patch.

What is *not* patched: vLLM itself (its CPU build is real), DeepSpeed's engine (its CPU
accelerator is real; only the JIT-compiled shared-memory collective and FusedAdam are swapped
for their pure-torch equivalents, as DeepSpeed does itself when asked), Ray, OpenRLHF's trainer
and experience maker, and our own actor/trainer classes. Two helpers of this package are loaded only where needed:
megatron-core's CPU shim (:mod:`openrlhf_div.compat.mcore_cpu`, for the Megatron actor) and the
CPU GEMM branch reader / forcer (:mod:`openrlhf_div.compat.vllm_cpu_gemm`, the weight sync's route
note and ``OPENRLHF_DIV_FORCE_CPU_GEMM``). Nothing here reads the checkout's ``tests/``: an
installed package runs the CPU path on its own.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Callable, Dict, List

ENV_FLAG = "OPENRLHF_DIV_CPU_SEAMS"

#: seam name -> (upstream location in openrlhf 0.11.2 / deepspeed 0.19.6, what replaces it)
SEAMS: Dict[str, tuple] = {
    "torch.cuda.set_device/synchronize/empty_cache/current_stream": (
        "openrlhf/utils/deepspeed/deepspeed.py:97, trainer/ray/launcher.py:64-65, "
        "trainer/ray/ppo_actor.py:417,436,489, utils/distributed_util.py:10, "
        "trainer/ray/vllm_worker_wrap.py:46",
        "no-ops (there is no device to select, synchronise or free); current_stream() -> None"),
    "torch.cuda.current_device": (
        "trainer/ray/ppo_actor.py:148,171, trainer/ray/launcher.py:136,190, "
        "trainer/ppo_utils/replay_buffer.py:104,129,159,165, utils/deepspeed/deepspeed.py:614,633",
        "returns 'cpu' (used as a tensor device)"),
    "NaiveReplayBuffer.target_device": (
        "trainer/ppo_utils/replay_buffer.py:40 (torch.device(f'cuda:{current_device()}'))",
        "torch.device('cpu') after __init__"),
    "DeepspeedStrategy.setup_distributed device mesh": (
        "utils/deepspeed/deepspeed.py:105-107 (init_device_mesh('cuda', ...))",
        "init_device_mesh('cpu', ...) (gloo)"),
    "DeepSpeed FusedAdam / shared-memory collective (JIT C++ builds)": (
        "utils/deepspeed/deepspeed.py:431 get_ds_train_config; deepspeed/comm/torch.py shm op",
        "optimizer params torch_adam=True; deepspeed_shm_comm marked incompatible"),
    "weight-sync process group (PyNccl)": (
        "utils/distributed_util.py:13-26 stateless_init_process_group, imported by name in "
        "trainer/ray/ppo_actor.py:24",
        "a gloo group on the same StatelessProcessGroup rendezvous; broadcast(tensor, src, stream)"),
    "megatron-core 0.16 CUDA-only corners (our Megatron actor's engine)": (
        "megatron/core hard-coded 'cuda' tensors, torch.cuda.current_device/streams, "
        "CudaRNGStatesTracker.fork (openrlhf_div/compat/mcore_cpu.py lists them)",
        "openrlhf_div.compat.mcore_cpu.megatron_cpu_compat around each MegatronEngine method"),
    "WorkerWrap.update_weight receive buffer": (
        "trainer/ray/vllm_worker_wrap.py:40 (torch.empty(..., device='cuda'))",
        "the buffer on the vLLM worker's own device (cpu)"),
    "WorkerWrap.update_weight load (vLLM CPU GEMM packing)": (
        "trainer/ray/vllm_worker_wrap.py:48 (self.model_runner.model.load_weights([(name, weight)]))",
        "openrlhf_div.compat.vllm_weights.update_vllm_weights: vLLM's layer-wise reload, so the "
        "update also lands where the CPU dispatch packed the weights (oneDNN / sgl-kernel / zentorch)"),
}

#: set to onednn / sgl / zentorch / fallback: every vLLM process of the cluster takes that CPU GEMM
#: branch (openrlhf_div/compat/vllm_cpu_gemm.py; stand-in kernels where this CPU lacks the real ones)
FORCE_GEMM_ENV = "OPENRLHF_DIV_FORCE_CPU_GEMM"

_PATCHED: set = set()


# ------------------------------------------------------------------ the patches
def _patch_torch() -> None:
    import torch

    cuda = torch.cuda
    if getattr(cuda, "_openrlhf_div_cpu_seams", False):
        return
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: None
    cuda.current_device = lambda: "cpu"
    cuda._openrlhf_div_cpu_seams = True


def _patch_replay_buffer(mod) -> None:
    import torch

    cls = mod.NaiveReplayBuffer
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        # upstream builds torch.device(f"cuda:{current_device()}"): give it an index while it
        # does (the device object is never used), then point the buffer at the CPU
        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current
        self.target_device = torch.device("cpu")

    cls.__init__ = __init__


def _patch_deepspeed_strategy(mod) -> None:
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    upstream_mesh = mod.init_device_mesh
    mod.init_device_mesh = lambda device_type, *a, **k: upstream_mesh("cpu", *a, **k)

    cls = mod.DeepspeedStrategy
    get_cfg = cls.get_ds_train_config

    def get_ds_train_config(self, *args, **kwargs):
        cfg = get_cfg(self, *args, **kwargs)
        opt = cfg.get("optimizer")
        if isinstance(opt, dict) and str(opt.get("type", "")).lower() in ("adam", "adamw"):
            opt.setdefault("params", {})["torch_adam"] = True
        return cfg

    cls.get_ds_train_config = get_ds_train_config


class _GlooBroadcaster:
    """The part of vLLM's ``PyNcclCommunicator`` that OpenRLHF's weight sync uses, over gloo."""

    def __init__(self, group, rank: int, world_size: int):
        self.group, self.rank, self.world_size = group, rank, world_size

    def broadcast(self, tensor, src: int = 0, stream=None):
        import torch

        # gloo has no bfloat16 / int16 broadcast; a broadcast only copies bytes, so send bf16 as
        # float16 bit patterns (the same two bytes per element, no arithmetic on them)
        buf = tensor.view(torch.float16) if tensor.dtype == torch.bfloat16 else tensor
        if not buf.is_contiguous():
            raise ValueError("weight sync: non-contiguous tensor")
        self.group.broadcast(buf, src).wait()
        return tensor


def stateless_init_process_group(master_address, master_port, rank, world_size, device=None):
    """CPU replacement of OpenRLHF's ``stateless_init_process_group``: same rendezvous
    arguments, a gloo process group instead of a PyNccl communicator."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    group = stateless_init_torch_distributed_process_group(
        master_address, int(master_port), int(rank), int(world_size), backend="gloo")
    return _GlooBroadcaster(group, int(rank), int(world_size))


def _patch_distributed_util(mod) -> None:
    mod.stateless_init_process_group = stateless_init_process_group


def _patch_ppo_actor(mod) -> None:
    mod.stateless_init_process_group = stateless_init_process_group


def _note_sync_route(model) -> None:
    """One line per vLLM worker at its first weight sync (in the job's logs): which module loads the
    weights and which CPU GEMM the layers took (the evidence that a forced branch was in effect)."""
    from collections import Counter

    import openrlhf_div.compat.vllm_weights as vw

    from openrlhf_div.compat.vllm_cpu_gemm import branch_of

    kinds = Counter(branch_of(m) for m in model.modules() if hasattr(m, "cpu_linear"))
    print(f"[cpu_seams] pid {os.getpid()}: weight sync through {vw.__file__}; CPU GEMM of the layers: "
          f"{dict(kinds)}; packed (layer-wise reload): {vw.holds_packed_weights(model)}", file=sys.stderr,
          flush=True)


def _patch_worker_wrap(mod) -> None:
    import torch

    cls = mod.WorkerWrap

    from openrlhf_div.compat.vllm_weights import update_vllm_weights

    def update_weight(self, name, dtype, shape, empty_cache=False):
        assert dtype == self.model_config.dtype, f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        self._model_update_group.broadcast(weight, src=0, stream=None)
        # upstream: self.model_runner.model.load_weights(weights=[(name, weight)]), which fails where
        # vLLM's CPU GEMM dispatch packed the weights (oneDNN / sgl-kernel / zentorch, issue 21)
        if not getattr(self, "_openrlhf_div_sync_noted", False):
            _note_sync_route(self.model_runner.model)
            self._openrlhf_div_sync_noted = True
        update_vllm_weights(self.model_runner.model, [(name, weight)], model_config=self.model_config)
        del weight

    cls.update_weight = update_weight


def _patch_megatron_engine(mod) -> None:
    """Run our Megatron engine's methods inside megatron-core's CPU shim (:mod:`.mcore_cpu`:
    megatron-core 0.16's few hard-coded ``"cuda"`` tensors and ``torch.cuda`` calls -> CPU), the
    shim the gloo tests of the engine use; the engine itself is unchanged."""
    import functools

    from openrlhf_div.compat.mcore_cpu import megatron_cpu_compat

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with megatron_cpu_compat():
                return fn(*args, **kwargs)
        return inner

    def wrap_gen(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with megatron_cpu_compat():
                yield from fn(*args, **kwargs)
        return inner

    cls = mod.MegatronEngine
    for name in ("__init__", "forward_log_probs", "train_step", "save_checkpoint", "load_checkpoint",
                 "offload", "reload", "save_hf"):
        setattr(cls, name, wrap(getattr(cls, name)))
    cls.iter_hf_weights = wrap_gen(cls.iter_hf_weights)
    mod.init_megatron_parallel = wrap(mod.init_megatron_parallel)


def _force_cpu_gemm(mod) -> None:
    """``OPENRLHF_DIV_FORCE_CPU_GEMM=<branch>``: vLLM's CPU GEMM dispatch takes that branch in this
    process (the e2e run that proves the weight sync on a packing branch on any CPU)."""
    branch = os.environ.get(FORCE_GEMM_ENV, "")
    if not branch:
        return
    from openrlhf_div.compat import vllm_cpu_gemm

    if branch not in vllm_cpu_gemm.BRANCHES:
        raise ValueError(f"{FORCE_GEMM_ENV}={branch!r}: not a CPU GEMM branch of vLLM 0.29; use one of "
                         f"{', '.join(vllm_cpu_gemm.BRANCHES)}, or unset it (vLLM picks from the CPU)")
    vllm_cpu_gemm.set_branch(branch)
    print(f"[cpu_seams] pid {os.getpid()}: vLLM's CPU GEMM dispatch forced to {branch} ({FORCE_GEMM_ENV})",
          file=sys.stderr, flush=True)


#: upstream module -> patch (applied right after the module is first imported)
HOOKS: Dict[str, Callable] = {
    "openrlhf": lambda mod: _patch_torch(),
    "openrlhf.trainer.ppo_utils.replay_buffer": _patch_replay_buffer,
    "openrlhf.utils.deepspeed.deepspeed": _patch_deepspeed_strategy,
    "openrlhf.utils.distributed_util": _patch_distributed_util,
    "openrlhf.trainer.ray.ppo_actor": _patch_ppo_actor,
    "openrlhf.trainer.ray.vllm_worker_wrap": _patch_worker_wrap,
    "openrlhf_div.engines.megatron.engine": _patch_megatron_engine,
    "vllm.model_executor.layers.utils": _force_cpu_gemm,
}

#: extra post-import hooks (the e2e probe registers its own through :func:`add_hook`)
_EXTRA: Dict[str, List[Callable]] = {}


def add_hook(module: str, fn: Callable) -> None:
    """Run ``fn(module_object)`` right after ``module`` is imported (now, if it already is)."""
    _EXTRA.setdefault(module, []).append(fn)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if module in sys.modules:
        fn(sys.modules[module])


def _apply(name: str, mod) -> None:
    if name in HOOKS and name not in _PATCHED:
        _PATCHED.add(name)
        HOOKS[name](mod)
    for fn in _EXTRA.get(name, []):
        fn(mod)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _apply(self.name, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of the hooked modules so the patch runs right after they execute."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in HOOKS and fullname not in _EXTRA:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


def install_import_hooks() -> None:
    """Patch every hooked module: those already imported now, the others when imported."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name in list(HOOKS):
        if name in sys.modules:
            _apply(name, sys.modules[name])


def enabled() -> bool:
    return os.environ.get(ENV_FLAG, "") == "1"


# ------------------------------------------------------------------ when and where it applies
#: the folder whose ``sitecustomize.py`` installs the hooks in every process that has it on PYTHONPATH
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_site")

#: what a CPU run's processes need besides the hooks (defaults; a value already set wins)
CPU_ENV: Dict[str, str] = {
    "DS_ACCELERATOR": "cpu",              # DeepSpeed's real CPU accelerator
    "VLLM_CPU_KVCACHE_SPACE": "1",        # GiB of KV cache per vLLM CPU engine (vLLM's default: 4)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    # vLLM's CPU platform turns OpenRLHF's executor choice for TP=1 ("uni", what a GPU runs: the
    # model in the EngineCore process) into "mp" (one more spawned process importing vLLM, ~15
    # CPU-s per engine) unless this is 0; with 0 the CPU run has the GPU's process layout.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def gpu_present() -> bool:
    """A CUDA device is visible to this process."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def cpu_mode(environ=None) -> bool:
    """Whether the CPU compatibility layer applies: ``OPENRLHF_DIV_CPU_SEAMS=1`` / ``0`` decide;
    unset, it applies exactly when no GPU is present."""
    environ = os.environ if environ is None else environ
    flag = environ.get(ENV_FLAG, "")
    if flag in ("0", "1"):
        return flag == "1"
    return not gpu_present()


def worker_env(environ=None) -> Dict[str, str]:
    """The variables every process of a CPU run gets (Ray runtime env ``env_vars``): the flag, the
    ``cpu_site`` folder in front of ``PYTHONPATH`` (Ray expands ``${PYTHONPATH}``) and
    :data:`CPU_ENV` (values already set in ``environ`` win)."""
    environ = os.environ if environ is None else environ
    out = {k: environ.get(k, v) for k, v in CPU_ENV.items()}
    out[ENV_FLAG] = "1"
    out["PYTHONPATH"] = SITE_DIR + os.pathsep + "${PYTHONPATH}"
    return out


def apply_here(environ=None) -> None:
    """This process: :data:`CPU_ENV` defaults, the flag, ``cpu_site`` on ``PYTHONPATH`` (for the
    processes it starts: a local Ray cluster's raylet and workers inherit them) and the hooks."""
    environ = os.environ if environ is None else environ
    for k, v in CPU_ENV.items():
        environ.setdefault(k, v)
    environ[ENV_FLAG] = "1"
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SITE_DIR not in parts:
        environ["PYTHONPATH"] = os.pathsep.join([SITE_DIR] + parts)
    install_import_hooks()
