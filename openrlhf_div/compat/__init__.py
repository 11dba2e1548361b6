"""Compatibility shims for running OpenRLHF code where its CUDA-only dependencies are absent.

* :mod:`.flash_attn_standin` — pure-torch ``flash_attn.bert_padding`` / ``all_gather``,
  installed by our OpenRLHF engine modules only when the real flash-attn is missing.
* :mod:`.vllm_stub` — an import-only vLLM stub for CPU tests and dry runs (installed only on
  explicit request, never by the training path).
* :mod:`.vllm_weights` — ``update_vllm_weights``: in-place weight updates into a live vLLM
  model that also hold where vLLM's CPU GEMM dispatch packed the weights (oneDNN, sgl-kernel,
  zentorch); imported by name, it needs vLLM.
"""
from .flash_attn_standin import install as install_flash_attn_standin
from .vllm_stub import install as install_vllm_stub

__all__ = ["install_flash_attn_standin", "install_vllm_stub"]
