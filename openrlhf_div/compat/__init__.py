"""Compatibility shims for running OpenRLHF code where its CUDA-only dependencies are absent.

* :mod:`.flash_attn_standin` — pure-torch ``flash_attn.bert_padding`` / ``all_gather``,
  installed by our OpenRLHF engine modules only when the real flash-attn is missing.
* :mod:`.vllm_stub` — an import-only vLLM stub for CPU tests and dry runs (installed only on
  explicit request, never by the training path).
* :mod:`.vllm_weights` — ``update_vllm_weights``: in-place weight updates into a live vLLM
  model that also hold where vLLM's CPU GEMM dispatch packed the weights (oneDNN, sgl-kernel,
  zentorch); imported by name, it needs vLLM.
* :mod:`.cpu_seams` — OpenRLHF's CUDA-only calls redirected to the CPU, applied whenever no GPU
  is present (every process of a CPU Ray run, through ``cpu_site/sitecustomize.py``).
* :mod:`.mcore_cpu` — megatron-core 0.16's CUDA-only corners redirected to the CPU (the Megatron
  actor's CPU path and its gloo tests) and ``run_multiprocess`` (N gloo processes).
* :mod:`.vllm_cpu_gemm` — which CPU GEMM branch vLLM's dispatch gave a layer, and forcing one
  (``OPENRLHF_DIV_FORCE_CPU_GEMM``) with stand-in kernels where this CPU lacks the real ones.

The ``install_*`` names are imported on first use: importing this package (as every process of a
CPU run does, for :mod:`.cpu_seams`) costs no torch import.
"""
import importlib

_LAZY = {"install_flash_attn_standin": ".flash_attn_standin",
         "install_vllm_stub": ".vllm_stub"}


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(_LAZY[name], __name__).install
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["install_flash_attn_standin", "install_vllm_stub"]
