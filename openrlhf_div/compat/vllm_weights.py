"""In-place weight updates into a live vLLM model that hold under every CPU GEMM dispatch.

The one CPU-only vLLM module of the package (``docs/scaling.md``, "CPU weight sync"). Import it
only where vLLM is installed; it imports vLLM lazily, on the first update that needs it.

Why it exists. After loading, vLLM 0.29's CPU platform hands every unquantized linear layer to
``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py``), which picks one of
four GEMMs from the CPU's capabilities:

* **oneDNN** (``onednn_mm``; any x86 CPU where the handle can be built for the dtype, e.g. bf16
  on AVX-512-BF16, float32 on AVX2),
* **sgl-kernel** (``weight_packed_linear``; AMX CPUs, small bf16/fp16 weights),
* **zentorch** (``zentorch_linear_unary``; AMD Zen with zentorch installed),
* **fallback** ``torch.nn.functional.linear`` (e.g. bf16 on an AVX2-only CPU).

The first three pack the weight into a kernel-owned copy and (for linear layers) replace
``layer.weight`` by an empty ``Parameter`` without a ``weight_loader``; the vocabulary
embedding keeps its weight but its logits GEMM (the tied ``lm_head``) reads the packed copy.
A plain ``model.load_weights([(name, w)])`` (what OpenRLHF's weight sync calls, one tensor at
a time) then fails (``'Parameter' object has no attribute 'weight_loader'``, or ``Attempted to
load weight ... into parameter (torch.Size([0]))``), or, for the embedding, silently leaves the
logits on the old weights. Only the fallback keeps the live weight that ``load_weights`` writes.

What it does. :func:`update_vllm_weights` takes vLLM's own route for in-place updates, the one
``GPUModelRunner.reload_weights`` and the weight-transfer engines use: the layer-wise reload
utilities of ``vllm/model_executor/model_loader/reload/`` (``initialize_layerwise_reload`` puts
every layer back in checkpoint format on the meta device, ``model.load_weights`` buffers each
layer's tensors and, once a layer has all of them, materialises it, loads them and re-runs its
``process_weights_after_loading`` -- i.e. the CPU GEMM dispatch, which packs the new weight --
and ``finalize_layerwise_reload`` puts the untouched layers back). Two additions:

* **one tensor at a time.** A fused layer (``qkv_proj``, ``gate_up_proj``) is complete only
  when all its HF tensors have arrived; OpenRLHF sends ``q_proj`` / ``k_proj`` / ``v_proj`` in
  separate calls. While a fused layer is incomplete the reload session stays open across calls
  (the model cannot run: a forward raises an error naming the missing tensors) and closes in
  the call that completes it. A call that leaves no fused layer half-loaded closes the session:
  the next forward uses every tensor given so far.
* **tied layers.** vLLM's reload re-processes only the layer that loaded a shared weight
  (``reload/__init__.py``, limitation 2): the tied ``lm_head`` would keep its packed copy of
  the old embedding. Every other layer that shares a parameter with a re-processed layer and
  holds a packed copy is re-processed as well.

Where no layer holds a packed copy (a GPU, or the CPU fallback) this is exactly
``model.load_weights(weights)``: those layers compute from the live parameter it writes.
"""
from __future__ import annotations

import contextlib
import logging
import types
import weakref
from typing import Iterable, List, Optional, Tuple

import torch

__all__ = ["update_vllm_weights", "holds_packed_weights", "pending_vllm_weights"]


class _Session:
    """One open layer-wise reload of a model (between the first and the completing call)."""

    def __init__(self) -> None:
        self.processed: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self.hook = None


_SESSIONS: "weakref.WeakKeyDictionary[torch.nn.Module, _Session]" = weakref.WeakKeyDictionary()


def _packed(layer: torch.nn.Module) -> bool:
    """True when ``layer``'s CPU GEMM computes from its own packed copy of the weight.

    ``dispatch_cpu_unquantized_gemm`` stores the chosen GEMM as ``layer.cpu_linear``: the
    oneDNN, sgl-kernel and zentorch branches are closures over the packed weight (the oneDNN
    handle, ``packed_weight``, ``zen_weight``); the fallback is a lambda over nothing that reads
    the live ``weight`` argument (and layers without weights get ``F.linear`` itself)."""
    fn = getattr(layer, "cpu_linear", None)
    return callable(fn) and bool(getattr(fn, "__closure__", None))


def holds_packed_weights(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` computes from a packed copy (oneDNN, sgl-kernel, zentorch),
    i.e. whether a plain ``model.load_weights`` would fail or be ignored."""
    return any(_packed(m) for m in model.modules())


def _shard_loaded(args) -> bool:
    """Whether a buffered weight-loader call loaded one shard of a fused parameter."""
    a = args.arguments
    return any(a.get(k) is not None for k in ("loaded_shard_id", "shard_id"))


def pending_vllm_weights(model: torch.nn.Module) -> List[str]:
    """Fused layers of ``model`` that have received some but not all of their tensors in the
    open update (``[]`` when no update is open): ``"<layer> (has: <param>[<shard>], ...)"``."""
    if model not in _SESSIONS:
        return []
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or not info.loaded_weights:
            continue
        if info.load_numel < info.load_numel_total and any(_shard_loaded(a) for _, a in info.loaded_weights):
            got = ", ".join(f"{p}[{a.arguments.get('loaded_shard_id', a.arguments.get('shard_id'))}]"
                            for p, a in info.loaded_weights)
            out.append(f"{name or type(layer).__name__} (has: {got})")
    return out


def _model_config(model: torch.nn.Module, model_config):
    """What ``finalize_layerwise_reload`` reads from the model config: only ``.dtype`` (the
    attention layers' ``process_weights_after_loading(act_dtype)``)."""
    if model_config is not None:
        return model_config
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is not None and getattr(cfg, "model_config", None) is not None:
        return cfg.model_config
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point() and p.numel() > 0),
                 torch.get_default_dtype())
    return types.SimpleNamespace(dtype=dtype)


def _forward_guard(model: torch.nn.Module):
    def hook(module, args, kwargs=None):
        raise RuntimeError(
            "update_vllm_weights: the model ran while a weight update was incomplete: "
            f"{'; '.join(pending_vllm_weights(module)) or 'a layer'} still lack tensors of their fused "
            "parameter (e.g. k_proj / v_proj after q_proj). Send the remaining tensors of each listed "
            "layer with update_vllm_weights before generating.")

    return model.register_forward_pre_hook(hook)


def _note_processed(model: torch.nn.Module, session: _Session) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for layer in model.modules():
        info = get_layerwise_info(layer)
        # initialize_layerwise_reload armed every layer (can_load); vLLM's online loader resets
        # a layer's info once it has loaded and re-processed it
        if not info.can_load() and layer not in session.processed:
            session.processed.add(layer)


def _reprocess_tied(model: torch.nn.Module, session: _Session) -> None:
    """Re-dispatch layers that share a parameter with a re-processed layer (the tied lm_head)
    but were not re-processed themselves, if they compute from a packed copy."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    fresh = {id(p) for layer in session.processed for p in layer._parameters.values() if p is not None}
    for layer in model.modules():
        if layer in session.processed or not _packed(layer):
            continue
        qm = getattr(layer, "quant_method", None)
        shares = any(p is not None and id(p) in fresh for p in layer._parameters.values())
        if shares and isinstance(qm, QuantizeMethodBase):
            qm.process_weights_after_loading(layer)


def update_vllm_weights(model: torch.nn.Module, weights: Iterable[Tuple[str, torch.Tensor]],
                        *, model_config=None) -> None:
    """Load Hugging Face-named tensors into vLLM's live ``model`` (the worker's
    ``model_runner.model``) so that the next forward uses them, whichever CPU GEMM dispatch its
    layers took (module docstring). ``weights``: one ``(name, tensor)`` or the full set, as
    ``model.load_weights`` takes them; a fused layer's tensors may come in consecutive calls.
    ``model_config``: vLLM's ``ModelConfig`` (only its ``dtype`` is read); default: the current
    vLLM config if one is set, else the model's parameter dtype."""
    session = _SESSIONS.get(model)
    if session is None:
        if not holds_packed_weights(model):
            model.load_weights(weights)  # GPU, CPU fallback: the layers read the live parameters
            return
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(model)
        session = _SESSIONS[model] = _Session()
        session.hook = _forward_guard(model)
    with torch.no_grad():
        model.load_weights(weights)
    _note_processed(model, session)
    if pending_vllm_weights(model):
        return  # a fused layer waits for the rest of its tensors (next call)
    _close(model, session, model_config)


#: vLLM's layer-wise reload logger and its warning for a layer that received no tensor in a reload
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
NO_TENSOR_WARNING = "%s: Failed to load weights"


class _NoTensorFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != NO_TENSOR_WARNING


@contextlib.contextmanager
def _expected_reload_warnings_quiet():
    """``finalize_layerwise_reload`` warns ``<Layer>: Failed to load weights`` for every layer that
    received no tensor in this reload session, then puts that layer's current (kernel) tensors
    back. Here that is expected, not a mismatch: OpenRLHF's sync sends one tensor per call, so a
    session holds one tensor (or one fused layer's) and every other layer of the model is
    "not loaded" in it (420 warnings in two tiny Ray steps); the local engine's full-set push
    leaves out the tied ``lm_head``, which :func:`_reprocess_tied` re-packs from the embedding.
    A layer's own update is checked elsewhere: an incomplete fused layer keeps the session open
    (:func:`pending_vllm_weights`), and tests/test_vllm_weights.py compares vLLM's log-probs after
    each update with a forward of the new weights. Only that one warning is dropped, only here."""
    log = logging.getLogger(RELOAD_LOGGER)
    flt = _NoTensorFilter()
    log.addFilter(flt)
    try:
        yield
    finally:
        log.removeFilter(flt)


def _close(model: torch.nn.Module, session: _Session, model_config=None) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    # layers that got tensors but not all of their elements (a vocabulary padded past the
    # checkpoint's rows) are processed by finalize ("delayed processing"): they count as fresh too
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load() and info.load_numel > 0:
            session.processed.add(layer)
    with torch.no_grad(), _expected_reload_warnings_quiet():
        finalize_layerwise_reload(model, _model_config(model, model_config))
        _reprocess_tied(model, session)
    session.hook.remove()
    del _SESSIONS[model]
