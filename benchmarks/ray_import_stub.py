"""The GPU bench's Ray *import* stub, for its one-process actor step where Ray is not installed.
Not a scheduler, and not part of the package (nothing else needs it).

OpenRLHF 0.11.2 defines its trainer classes next to their Ray actors: ``ActorPPOTrainer`` lives in
``openrlhf.trainer.ray.ppo_actor``, which imports ``ray`` and decorates ``PolicyModelActor`` with
``@ray.remote(num_gpus=1)`` at import time (``launcher.py`` and ``vllm_engine.py`` likewise, and
``from ray.util.placement_group import ...``). The GPU bench (``benchmarks/gpu_bench.py``) runs one
actor training step in one process, where no actor is ever started, on a machine where Ray's wheel
(~74 MB) cannot be carried. :func:`install` registers a module that satisfies exactly those
imports: ``ray.remote`` returns a handle whose ``__ray_actor_class__`` is the decorated class (as
Ray's does) and whose ``.remote()`` / ``.options()`` raise; ``ray.get`` / ``put`` / ``init`` /
``wait`` / ``kill`` raise a clear error.

Installed by ``gpu_bench.py``'s ``actor_step`` case **only when the real package is absent**;
nothing in the package installs it. The Ray topology needs real Ray.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

STUB_VERSION = "0.0.0+openrlhf_div.stub"
_MSG = ("Ray is not installed: this is benchmarks/ray_import_stub.py, the GPU bench's import stub for "
        "its one-process actor step. Install ray (see docker/Dockerfile) to start actors.")


def _unavailable(*args, **kwargs):
    raise RuntimeError(_MSG)


class _ActorClassStub:
    """What ``ray.remote(cls)`` returns: the class stays reachable as ``__ray_actor_class__``."""

    def __init__(self, cls, options):
        self.__ray_actor_class__ = cls
        self._options = dict(options)
        self.__name__ = getattr(cls, "__name__", "ActorClass")
        self.__doc__ = getattr(cls, "__doc__", None)

    def remote(self, *args, **kwargs):
        raise RuntimeError(_MSG)

    def options(self, *args, **kwargs):
        raise RuntimeError(_MSG)


def remote(*args, **kwargs):
    """``@ray.remote`` and ``@ray.remote(num_gpus=1)``: classes get an :class:`_ActorClassStub`;
    functions are returned as they are, with ``.remote`` raising."""
    def wrap(obj):
        if isinstance(obj, type):
            return _ActorClassStub(obj, kwargs)
        obj.remote = _unavailable
        return obj

    if len(args) == 1 and not kwargs and callable(args[0]):
        return wrap(args[0])
    return wrap


def real_ray_present() -> bool:
    mod = sys.modules.get("ray")
    if mod is not None:
        return not getattr(mod, "__openrlhf_div_stub__", False)
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def _module(name: str, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name, f"openrlhf-div import stub for {name} (no Ray installed)")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        mod.__path__ = []
    mod.__openrlhf_div_stub__ = True
    return mod


class PlacementGroup:  # a type name for annotations; never built here
    def __init__(self, *args, **kwargs):
        raise RuntimeError(_MSG)


class PlacementGroupSchedulingStrategy(PlacementGroup):
    pass


def install() -> bool:
    """Register the stub if Ray is absent; returns True when the stub is (now) in place."""
    if "ray" in sys.modules:
        return bool(getattr(sys.modules["ray"], "__openrlhf_div_stub__", False))
    if real_ray_present():
        return False
    root = _module("ray", package=True)
    root.__version__ = STUB_VERSION
    root.remote = remote
    for name in ("get", "put", "init", "wait", "kill", "get_actor", "available_resources", "cluster_resources"):
        setattr(root, name, _unavailable)
    root.is_initialized = lambda: False
    util = _module("ray.util", package=True)
    pg = _module("ray.util.placement_group")
    pg.PlacementGroup = PlacementGroup
    pg.placement_group = _unavailable
    pg.get_current_placement_group = lambda: None
    pg.remove_placement_group = _unavailable
    ss = _module("ray.util.scheduling_strategies")
    ss.PlacementGroupSchedulingStrategy = PlacementGroupSchedulingStrategy
    ss.NodeAffinitySchedulingStrategy = PlacementGroupSchedulingStrategy
    util.placement_group, util.scheduling_strategies = pg, ss
    util.get_node_ip_address = lambda: "127.0.0.1"
    root.util = util
    sys.modules.update({"ray": root, "ray.util": util, "ray.util.placement_group": pg,
                        "ray.util.scheduling_strategies": ss})
    return True
