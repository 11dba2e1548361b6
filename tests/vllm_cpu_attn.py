"""Force vLLM 0.29's CPU attention ISA choice on any x86 CPU, and run a scenario (test-only helper).

``CPUAttentionMetadataBuilder`` asks ``_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)``
(``vllm/v1/attention/backends/cpu_attn.py``) once per KV-cache group and stamps the answer on every
attention layer (``layer.isa``); the same ISA string then selects the kernel in the three ops
``cpu_attn_get_scheduler_metadata``, ``cpu_attn_reshape_and_cache`` and
``cpu_attention_with_kv_cache``. The answers on x86:

* ``vec16`` when ``head_size % 32 != 0 and head_size % 16 == 0`` (any CPU: runs for real here);
* ``amx`` when the CPU has AMX tiles (``torch.cpu._is_amx_tile_supported()``), the dtype is
  bfloat16 and ``block_size % 32 == 0`` (Sapphire Rapids and later);
* ``vec`` otherwise.

:func:`force_amx` makes ``_get_attn_isa`` see an AMX CPU (vLLM's own conditions still decide: a
float32 engine stays on ``vec``). Where this CPU has no AMX the ``amx`` kernels cannot run (their
tile instructions are illegal here), so the three ops get a stand-in for ``isa="amx"`` that first
checks the real kernel's contract -- above all **that this process asked the kernel for AMX tile
data** (``arch_prctl(ARCH_REQ_XCOMP_PERM)``; without it the real kernel dies with SIGILL, the Xeon
report of issue 29) -- then bf16 query and cache, ``head_size % 32 == 0``, ``block_size % 32 == 0``
-- and computes with the real ``vec`` kernel (the three ops consistently, so the KV-cache layout
matches). On an AMX CPU nothing is replaced: the real ``amx`` kernel runs.

Run as a script (``python tests/vllm_cpu_attn.py SCENARIO MODEL_DIR``) it builds one engine and
prints one JSON line: the ISA of each attention layer, the plugin's AMX state in the engine process
and in this one, and the generated tokens (``tests/test_vllm_amx.py``).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict

import torch

#: which kernel ran for "amx": "kernel" (the real one, AMX CPU) or "stand-in"
USED: Dict[str, str] = {}
_HAS_AMX = bool(torch.cpu._is_amx_tile_supported())


class AMXPermissionMissing(RuntimeError):
    """What the real AMX kernel does without the permission, as an exception (it is SIGILL)."""


def amx_contract(query: torch.Tensor, key_cache: torch.Tensor, head_dim: int, block_size: int) -> None:
    from openrlhf_div.compat import vllm_plugin

    state = vllm_plugin.amx_state()
    if not state["requested"]:
        raise AMXPermissionMissing(
            f"AMX attention kernel called in process {os.getpid()} which never requested AMX tile data "
            "(arch_prctl ARCH_REQ_XCOMP_PERM / torch.cpu._init_amx): on an AMX CPU this is SIGILL")
    if query.dtype != torch.bfloat16 or key_cache.dtype != torch.bfloat16:
        raise RuntimeError(f"amx attention: expect bf16 query and cache, got {query.dtype} / {key_cache.dtype}")
    if head_dim % 32 or block_size % 32:
        raise RuntimeError(f"amx attention: head_dim {head_dim} and block_size {block_size} must be multiples of 32")


def force_amx() -> None:
    """From now on this process's CPU attention sees an AMX CPU (stand-in kernels if it has none)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    if getattr(cpu_attn._get_attn_isa, "_forced", False):
        return
    real_isa = cpu_attn._get_attn_isa

    def _get_attn_isa(*args, **kwargs):
        saved = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            return real_isa(*args, **kwargs)
        finally:
            torch.cpu._is_amx_tile_supported = saved

    _get_attn_isa._forced = True
    cpu_attn._get_attn_isa = _get_attn_isa
    if _HAS_AMX:
        USED["amx"] = "kernel"
        return
    real_meta, real_cache, real_attn = (ops.cpu_attn_get_scheduler_metadata, ops.cpu_attn_reshape_and_cache,
                                        ops.cpu_attention_with_kv_cache)

    def cpu_attn_get_scheduler_metadata(*args, **kwargs):
        if kwargs.get("isa") == "amx":
            kwargs["isa"] = "vec"
        return real_meta(*args, **kwargs)

    def cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa, *rest, **kw):
        if isa == "amx":
            amx_contract(key, key_cache, key.shape[-1], key_cache.shape[2])
            isa = "vec"
        return real_cache(key, value, key_cache, value_cache, slot_mapping, isa, *rest, **kw)

    def cpu_attention_with_kv_cache(query, key_cache, value_cache, *rest, **kw):
        meta = _LAST_ISA.get("isa")
        if meta == "amx":
            amx_contract(query, key_cache, query.shape[-1], key_cache.shape[2])
            USED["amx"] = "stand-in"
        return real_attn(query, key_cache, value_cache, *rest, **kw)

    ops.cpu_attn_get_scheduler_metadata = cpu_attn_get_scheduler_metadata
    ops.cpu_attn_reshape_and_cache = cpu_attn_reshape_and_cache
    ops.cpu_attention_with_kv_cache = cpu_attention_with_kv_cache
    # cpu_attention_with_kv_cache carries no ISA argument (it is inside the scheduler metadata):
    # remember the layer's ISA as the backend's forward hands it to reshape_and_cache first
    real_forward = cpu_attn.CPUAttentionBackendImpl.forward

    def forward(self, layer, *args, **kwargs):
        _LAST_ISA["isa"] = getattr(layer, "isa", None)
        return real_forward(self, layer, *args, **kwargs)

    cpu_attn.CPUAttentionBackendImpl.forward = forward


_LAST_ISA: Dict[str, object] = {}


def save_model(path: str, *, head_dim: int = 64, dtype: str = "bfloat16") -> str:
    """A tiny tied Qwen2 (2 layers, 2 heads of ``head_dim``) saved in ``dtype``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if not os.path.exists(os.path.join(path, "config.json")):
        cfg = Qwen2Config(vocab_size=32, hidden_size=2 * head_dim, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim,
                          max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0,
                          eos_token_id=1, bos_token_id=1)
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    return path


def _engine_report(worker) -> dict:
    from openrlhf_div.compat import vllm_plugin

    isas = {name: getattr(m, "isa", None) for name, m in worker.model_runner.model.named_modules()
            if type(m).__name__ == "Attention"}
    return {"isa": isas, "amx": vllm_plugin.amx_state(), "used": dict(USED)}


def run(scenario: str, model_dir: str, dtype: str) -> dict:
    from vllm import LLM, SamplingParams

    if scenario.startswith("amx"):
        force_amx()
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=128,
              seed=0, enable_prefix_caching=False)
    out = llm.generate([{"prompt_token_ids": [3, 5, 7, 2, 9, 4]}] * 4,
                       SamplingParams(max_tokens=8, temperature=1.0, seed=0, detokenize=False), use_tqdm=False)
    from openrlhf_div.compat import vllm_plugin

    report = llm.collective_rpc(_engine_report)[0]
    report.update(front_pid=os.getpid(), front_amx=vllm_plugin.amx_state(),
                  tokens=[list(o.outputs[0].token_ids) for o in out])
    return report


if __name__ == "__main__":
    scenario, model_dir, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    try:
        print("REPORT " + json.dumps(run(scenario, model_dir, dtype)), flush=True)
    except Exception as e:  # the scenario's failure, for the test to read
        chain, cur = [], e
        while cur is not None:
            chain.append(f"{type(cur).__name__}: {cur}")
            cur = cur.__cause__ or cur.__context__
        print("FAILED " + json.dumps(chain), flush=True)
        sys.exit(3)
