"""A vLLM *import* stub for CPU tests and dry runs. Not a sampler.

``openrlhf.trainer.ray`` imports ``vllm`` (``SamplingParams``, ``vllm.inputs.TokensPrompt``,
``vllm.utils.random_uuid``) at module import time, and vLLM does not install on a CPU-only
machine. :func:`install` registers a module that satisfies those imports so our actor,
experience maker and trainer classes can be imported and unit-tested on CPU. Anything that
would actually need vLLM (creating an engine) raises a clear error.

It is installed **only on request** and **only when the real package is absent**; nothing in
the training path installs it. The CPU set-up (scripts/setup_env.sh) installs vLLM's CPU build,
so there :func:`install` does nothing and the unit tests that call it import the real vLLM
without starting an engine (they test classes, not rollouts: an engine is what tests/e2e starts).
It remains for machines without vLLM: the GPU bench's one-process actor step (benchmarks/gpu_bench.py) and minimal
installs.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
import uuid

STUB_VERSION = "0.0.0+openrlhf_div.stub"


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "vLLM is not installed: this is openrlhf_div.compat.vllm_stub, an import stub for CPU "
            "tests. Install vllm (see docker/Dockerfile) to run rollouts."
        )

    @classmethod
    def from_engine_args(cls, *args, **kwargs):
        cls()


class SamplingParams:
    """Records its keyword arguments (enough for code that builds and inspects params)."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def __repr__(self):
        return f"SamplingParams({self.__dict__})"


def real_vllm_present() -> bool:
    mod = sys.modules.get("vllm")
    if mod is not None:
        return not getattr(mod, "__openrlhf_div_stub__", False)
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _module(name: str, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name, f"openrlhf-div import stub for {name} (CPU tests only)")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        mod.__path__ = []
    mod.__openrlhf_div_stub__ = True
    return mod


def install() -> bool:
    """Register the stub if vLLM is absent; returns True when the stub is (now) in place."""
    if "vllm" in sys.modules:
        return bool(getattr(sys.modules["vllm"], "__openrlhf_div_stub__", False))
    if real_vllm_present():
        return False
    root = _module("vllm", package=True)
    root.__version__ = STUB_VERSION
    root.SamplingParams = SamplingParams
    root.AsyncEngineArgs = _Unavailable
    root.AsyncLLMEngine = _Unavailable
    root.LLM = _Unavailable
    inputs = _module("vllm.inputs")
    inputs.TokensPrompt = dict
    utils = _module("vllm.utils")
    utils.random_uuid = lambda: uuid.uuid4().hex
    root.inputs, root.utils = inputs, utils
    sys.modules.update({"vllm": root, "vllm.inputs": inputs, "vllm.utils": utils})
    return True
