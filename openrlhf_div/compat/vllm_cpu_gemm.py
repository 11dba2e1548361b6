"""Force vLLM 0.29's CPU GEMM dispatch into a chosen branch on any x86 CPU.

``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py``) picks, per layer, at
load time and again whenever a layer is re-processed:

* ``zentorch`` when ``current_platform.is_zen_cpu()`` and zentorch's ops exist,
* ``sgl`` (sgl-kernel ``weight_packed_linear``) when ``check_cpu_sgl_kernel`` (AMX, small
  bf16/fp16/int8 weights whose shape tiles: ``k % 32 == 0 and n % 16 == 0`` or ``n < 16``),
* ``onednn`` when vLLM's ops carry ``create_onednn_mm_handler`` and the handle builds for
  the dtype,
* ``fallback`` ``F.linear`` otherwise.

:func:`set_branch` wraps that function so that, while it runs, the capability answers it reads
pick the requested branch *as the CPU family that takes it would*: ``sgl`` makes
``torch.cpu._is_amx_tile_supported()`` answer True and leaves vLLM's own ``check_cpu_sgl_kernel``
to judge dtype and shape (so a float32 engine never lands on sgl-kernel, as on a real AMX Xeon;
:func:`expected_branch` says what each layer gets), ``onednn`` answers "no AMX",
``zentorch`` ``is_zen_cpu()``, ``fallback`` "no AMX, no oneDNN". vLLM's own branch code then
runs unchanged (the packing, the removal of
``layer.weight``, the ``cpu_linear`` closure). Only a **kernel** this CPU cannot run is replaced,
by the smallest stand-in that keeps the branch's contract (a packed copy owned by the kernel,
the live ``layer.weight`` never read) and **refuses what the real kernel refuses** (read from
vLLM 0.29's ``csrc/cpu`` sources and Python wrappers: dtypes, shapes, the fp32 bias sgl-kernel
expects), so a test that the real kernel would fail fails on every CPU:

* oneDNN: the real ``create_onednn_mm`` / ``onednn_mm`` run wherever the handle builds
  (float32 on an AVX2 CPU, bf16 on AVX-512-BF16); only where it raises (bf16 on AVX2) a
  stand-in handle keeps a transposed copy and multiplies with it.
* sgl-kernel: ``torch.ops._C.convert_weight_packed`` / ``weight_packed_linear`` exist only in
  vLLM's AVX-512 build (``_C_AVX512``, which an AVX2 CPU cannot load; an AVX-512 CPU, AMD or
  Intel, runs the real ones); where missing, the stand-ins pack to a transposed copy and multiply
  with it, after the real kernel's checks (weight bf16/fp16/int8, 2-D; activation of the weight's
  dtype; bias float32).
* zentorch: not installed here; where missing, ``torch.ops.zentorch.zentorch_linear_unary`` /
  ``zentorch_weight_prepack_for_linear`` stand-ins do the same.

docs/scaling.md ("CPU weight sync") names these stand-ins. Used by
``tests/test_vllm_weights.py`` and, in every process of the CPU e2e cluster, by
``openrlhf_div/compat/cpu_seams.py`` (the weight sync's one-line route note, and the forced branch
when ``OPENRLHF_DIV_FORCE_CPU_GEMM`` names one): the CPU path runs it, so it lives in the package.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List

import torch

BRANCHES = ("onednn", "sgl", "zentorch", "fallback")

#: which kernel ran where: branch -> "kernel" (vLLM's real op) / "stand-in", set when packing
USED: Dict[str, str] = {}


def branch_of(layer: torch.nn.Module) -> str:
    """The branch ``layer``'s ``cpu_linear`` came from ('' for a layer vLLM did not dispatch)."""
    fn = getattr(layer, "cpu_linear", None)
    if fn is None:
        return ""
    if fn is torch.nn.functional.linear:
        return "fallback"  # layers without weights (meta) get F.linear itself
    names = set(getattr(getattr(fn, "__code__", None), "co_names", ()))
    for op, branch in (("onednn_mm", "onednn"), ("weight_packed_linear_cpu", "sgl"),
                       ("zentorch_linear_unary", "zentorch")):
        if op in names:
            return branch
    return "fallback" if "linear" in names else "?"


# ------------------------------------------------------------------ kernel stand-ins
class StandinOneDNNHandle:
    """What ``create_onednn_mm`` returns where oneDNN cannot build the handle for the dtype."""

    def __init__(self, weight_kn: torch.Tensor):
        if weight_kn.dtype not in (torch.float32, torch.bfloat16):  # what oneDNN's CPU matmul packs
            raise RuntimeError(f"oneDNN stand-in: unsupported weight dtype {weight_kn.dtype}")
        self.packed = weight_kn.detach().contiguous().clone()  # [K, N], owned by the "kernel"
        self.k, self.n = self.packed.shape


def _standin_mm(x: torch.Tensor, packed_kn: torch.Tensor, bias, n: int) -> torch.Tensor:
    out = x.reshape(-1, x.size(-1)).float() @ packed_kn.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


#: the weight dtypes sgl-kernel's convert_weight_packed accepts (csrc/cpu/sgl-kernels/gemm.cpp)
SGL_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.int8)
SGL_DTYPE_ERROR = "expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4)"


def sgl_pack_contract(weight: torch.Tensor) -> torch.Tensor:
    """The real ``convert_weight_packed``'s checks, then a [K, N] copy (float32 where N < 16, as
    the real kernel transposes to fp32 instead of VNNI-packing below one tile)."""
    if weight.dtype not in SGL_WEIGHT_DTYPES:
        raise RuntimeError(SGL_DTYPE_ERROR)  # the real kernel's message, verbatim
    if weight.dim() != 2:
        raise RuntimeError(f"convert_weight_packed: expect a 2-D weight, got {tuple(weight.shape)}")
    packed = weight.detach().t().contiguous().clone()
    return packed.float() if weight.shape[0] < 16 else packed


def sgl_linear_contract(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias) -> None:
    """The real ``weight_packed_linear``'s checks on its inputs."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(f"weight_packed_linear: expect the activation in bf16/fp16, got {x.dtype}")
    if packed.dtype not in (x.dtype, torch.float32):
        raise RuntimeError(f"weight_packed_linear: weight {packed.dtype} does not match activation {x.dtype}")
    if bias is not None and bias.dtype != torch.float32:
        raise RuntimeError(f"weight_packed_linear: expect a float32 bias, got {bias.dtype}")
    if x.size(-1) != packed.shape[0] or out.dtype != x.dtype:
        raise RuntimeError("weight_packed_linear: shape or output dtype mismatch")


def _install_kernels() -> List[Callable[[], None]]:
    """Install the stand-ins this CPU needs (never over a kernel that exists); return undos."""
    from vllm import _custom_ops as ops

    undo: List[Callable[[], None]] = []
    if not getattr(ops.create_onednn_mm, "_standin_wrapper", False):
        real_create, real_mm = ops.create_onednn_mm, ops.onednn_mm

        def create_onednn_mm(weight, primitive_cache_size=128):
            try:
                handle = real_create(weight, primitive_cache_size)
                USED["onednn"] = "kernel"
                return handle
            except RuntimeError:  # e.g. bf16 on a CPU without AVX-512-BF16
                USED["onednn"] = "stand-in"
                return StandinOneDNNHandle(weight)

        def onednn_mm(handler, x, bias):
            if isinstance(handler, StandinOneDNNHandle):
                if x.dtype != handler.packed.dtype or x.size(-1) != handler.k:
                    raise RuntimeError(f"onednn_mm stand-in: activation {x.dtype} {tuple(x.shape)} does not "
                                       f"match the handle ({handler.packed.dtype}, K={handler.k})")
                return _standin_mm(x, handler.packed, bias, handler.n)
            return real_mm(handler, x, bias)

        create_onednn_mm._standin_wrapper = True
        ops.create_onednn_mm, ops.onednn_mm = create_onednn_mm, onednn_mm

        def _undo_onednn():
            ops.create_onednn_mm, ops.onednn_mm = real_create, real_mm

        undo.append(_undo_onednn)

    c_ops = torch.ops._C
    if not hasattr(c_ops, "convert_weight_packed"):
        def convert_weight_packed(weight):
            USED["sgl"] = "stand-in"
            return sgl_pack_contract(weight)

        def weight_packed_linear(out, x, packed, bias, is_vnni):
            sgl_linear_contract(out, x, packed, bias)
            out.copy_(_standin_mm(x, packed, bias, packed.shape[1]).reshape(out.shape))

        setattr(c_ops, "convert_weight_packed", convert_weight_packed)
        setattr(c_ops, "weight_packed_linear", weight_packed_linear)
        undo.append(lambda: (delattr(c_ops, "convert_weight_packed"), delattr(c_ops, "weight_packed_linear")))

    zen = torch.ops.zentorch
    if not hasattr(zen, "zentorch_linear_unary"):
        def zentorch_weight_prepack_for_linear(weight):
            return weight.detach().t().contiguous().clone()  # [K, N]

        def zentorch_linear_unary(x, weight, bias, is_weight_prepacked=False):
            USED["zentorch"] = "stand-in"
            packed = weight if is_weight_prepacked else weight.t()
            return _standin_mm(x, packed, bias, packed.shape[1])

        setattr(zen, "zentorch_weight_prepack_for_linear", zentorch_weight_prepack_for_linear)
        setattr(zen, "zentorch_linear_unary", zentorch_linear_unary)
        undo.append(lambda: (delattr(zen, "zentorch_weight_prepack_for_linear"),
                             delattr(zen, "zentorch_linear_unary")))
    return undo


# ------------------------------------------------------------------ the branch choice
@contextlib.contextmanager
def _choose(branch: str):
    """While vLLM's dispatch runs: the capability answers that select ``branch``."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils

    platform = utils.current_platform
    saved = (utils.check_cpu_sgl_kernel, ops._supports_onednn, platform.__dict__.get("is_zen_cpu"),
             torch.cpu._is_amx_tile_supported)
    platform.is_zen_cpu = lambda: branch == "zentorch"
    if branch == "sgl":  # an AMX CPU: vLLM's own check judges dtype and shape
        torch.cpu._is_amx_tile_supported = lambda: True
    else:
        utils.check_cpu_sgl_kernel = lambda n, k, dtype: False
    ops._supports_onednn = branch == "onednn" or (branch == "sgl" and saved[1])
    try:
        yield
    finally:
        utils.check_cpu_sgl_kernel, ops._supports_onednn = saved[0], saved[1]
        torch.cpu._is_amx_tile_supported = saved[3]
        if saved[2] is None:
            del platform.is_zen_cpu
        else:
            platform.is_zen_cpu = saved[2]


def expected_branch(branch: str, n: int, k: int, dtype: torch.dtype) -> str:
    """The branch vLLM's dispatch gives an [n, k] ``dtype`` weight on the CPU family that
    ``branch`` stands for (sgl: an AMX CPU, where vLLM's own ``check_cpu_sgl_kernel`` decides and
    the rest goes to oneDNN)."""
    if branch != "sgl":
        return branch
    from vllm.model_executor.layers import utils

    real = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: True
    try:
        return "sgl" if utils.check_cpu_sgl_kernel(n, k, dtype) else "onednn"
    finally:
        torch.cpu._is_amx_tile_supported = real


_STATE: Dict[str, object] = {"branch": None, "undo": []}


def set_branch(branch: str) -> None:
    """From now on every CPU GEMM dispatch in this process takes ``branch`` (one of
    :data:`BRANCHES`); stand-in kernels are installed where this CPU lacks the real ones."""
    if branch not in BRANCHES:
        raise ValueError(f"unknown CPU GEMM branch {branch!r}; one of {', '.join(BRANCHES)}")
    from vllm.model_executor.layers import utils

    if _STATE["branch"] is None:
        real = utils.dispatch_cpu_unquantized_gemm

        def dispatch_cpu_unquantized_gemm(layer, remove_weight):
            with _choose(_STATE["branch"]):
                return real(layer, remove_weight)

        utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
        undo = _install_kernels()

        def _undo_dispatch():
            utils.dispatch_cpu_unquantized_gemm = real

        _STATE["undo"] = undo + [_undo_dispatch]
    _STATE["branch"] = branch


def reset() -> None:
    """Undo :func:`set_branch` (vLLM's own choice again; stand-ins removed)."""
    for fn in reversed(_STATE["undo"]):
        fn()
    _STATE.update(branch=None, undo=[])

