"""vLLM 0.29 + torch 2.13 on CPU: let the second start of an engine reuse its compiled graph.

Why it compiles again at every start (read from the installed sources): vLLM's CPU platform
compiles with plain Inductor (``CompilationMode.DYNAMO_TRACE_ONCE``, backend ``"inductor"``,
``vllm/platforms/cpu.py``), not with vLLM's own backend. With AOT compilation on (vLLM's default
for torch >= 2.10, ``VLLM_USE_AOT_COMPILE``), torch wraps Inductor's result in
``torch._dynamo.aot_compile_types.BundledAOTAutogradSerializableCallable`` and saves it. On the
next start ``vllm.compilation.decorators._try_load_aot_compiled_fn`` loads it and calls
``loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)`` - a method of vLLM's own
``VllmSerializableFunction`` (which builds vLLM's backend lazily). The Inductor wrapper has no such
method; its ``__getattr__`` forwards to the wrapped compiled function, a plain ``function``, so the
call raises ``AttributeError: 'function' object has no attribute 'finalize_loading'``, vLLM logs
"Compiling model again due to a load failure" and compiles from scratch.

The fix: the wrapper gets a ``finalize_loading`` that does nothing - the Inductor artifact is
complete once deserialized (``deserialize_bundled_cache_entry`` already rebuilt the callable);
there is no vLLM backend to build. :func:`allow_inductor_aot_reload` installs it once per process
(the local engine's vLLM sampler runs vLLM in-process); it leaves a torch whose wrapper already has
the method alone.
"""
from __future__ import annotations


def _finalize_loading(self, vllm_config) -> None:  # noqa: ARG001 - vLLM's signature
    """Nothing to finish: the Inductor artifact was rebuilt whole when it was deserialized."""


def allow_inductor_aot_reload() -> bool:
    """Install the no-op ``finalize_loading``; True when this process now has it (installed here
    or before), False when torch lacks the wrapper class (another torch: nothing to fix)."""
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Wrapper
    except ImportError:
        return False
    if "finalize_loading" not in vars(Wrapper):
        Wrapper.finalize_loading = _finalize_loading
    return True
