"""The local engine's one sampler seam: a small protocol and a registry of backends.

Every place of the local engine that samples (the trainer's rollouts, DPH pre-sampling, the
evaluation before / during / after training and ``openrlhf-div eval --engine local|vllm``) asks
this module for a :class:`Sampler` and calls its four methods; none of them tests a backend name
or a ``None`` sampler.

=========  ===================================================================================
method     contract
=========  ===================================================================================
generate   ``generate(prompts, *, n_samples, max_new_tokens, temperature, top_p, generator,
           batch_size)`` -> :class:`.generation.GenerationOutput` (one row per sample, rows of a
           prompt contiguous; randomness only from ``generator``)
sync       ``sync(model)``: the policy's current weights reach the sampler (after an optimizer
           step, or to wake it); ``push_seconds`` says how long that took
sleep      free what the sampler holds while the trainer runs (GPU vLLM: KV cache and weights)
close      release the sampler for good (a later ``generate`` raises)
=========  ===================================================================================

Registered backends (``rollout.backend``): ``hf`` (:func:`.generation.generate`, the local KV-cache
sampler over the policy itself: it shares the policy's weights, so ``sync`` / ``sleep`` are
no-ops) and ``vllm`` (:class:`.vllm_sampler.VLLMSampler`, an in-process vLLM engine). ``auto``
takes the first of :data:`AUTO_ORDER` that can run here, with one line saying why the others
cannot. A new backend is one :func:`register_sampler` call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Union

try:  # typing.Protocol is 3.8+; runtime_checkable for the tests' isinstance checks
    from typing import Protocol, runtime_checkable
except ImportError:  # pragma: no cover
    from typing_extensions import Protocol, runtime_checkable  # type: ignore


@runtime_checkable
class Sampler(Protocol):
    """What the trainer, pre-sampling and evaluation call (see the module docstring)."""

    name: str
    awake: bool
    push_seconds: float

    def generate(self, prompts: Sequence[Union[str, Sequence[int]]], *, n_samples: int = 1,
                 max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0, generator=None,
                 batch_size: Optional[int] = None):
        ...

    def sync(self, model) -> None:
        ...

    def sleep(self) -> None:
        ...

    def close(self) -> None:
        ...


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here; the message says why and what to use
    (``reason``: the why alone, for callers that phrase the fix in their own options). The CLI
    prints it as one line (``cli/main.py`` knows it by this name)."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


@dataclass(frozen=True)
class SamplerSpec:
    """A registered backend: ``factory(model, tokenizer, rollout_cfg, *, device, seed)`` builds
    the :class:`Sampler`; ``unsupported(model, device)`` says why it cannot run here (None: it
    can), cheaply, before anything is built."""

    name: str
    factory: Callable[..., Sampler]
    unsupported: Callable[..., Optional[str]]
    description: str = ""
    label: str = ""  # how messages name it (default: the name)


_REGISTRY: Dict[str, SamplerSpec] = {}
AUTO_ORDER = ("vllm", "hf")  # what ``auto`` tries, in order


def register_sampler(name: str, factory: Callable[..., Sampler], *,
                     unsupported: Optional[Callable[..., Optional[str]]] = None, description: str = "",
                     label: str = "") -> None:
    if not name or name == "auto":
        raise ValueError(f"a sampler backend cannot be named {name!r}")
    _REGISTRY[name] = SamplerSpec(name, factory, unsupported or (lambda model, device: None), description,
                                  label or name)


def sampler_names() -> Sequence[str]:
    """The registered backends, sorted (``auto`` is not one: it picks among them)."""
    return tuple(sorted(_REGISTRY))


def backend_choices() -> Sequence[str]:
    """What ``rollout.backend`` accepts: ``auto`` and every registered backend."""
    return ("auto",) + tuple(sampler_names())


def get_spec(name: str) -> SamplerSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown sampler backend {name!r}; choose one of {', '.join(backend_choices())} "
                         f"(rollout.backend)")
    return _REGISTRY[name]


def resolve_backend(requested: str, model, device, *, log=print) -> str:
    """The registered backend ``requested`` names (``auto``: the first of :data:`AUTO_ORDER` that
    can run here; one log line says why each one before it cannot). An explicit backend that cannot
    run raises :class:`SamplerUnavailable` naming the reason and the alternatives."""
    if requested == "auto":
        reasons = []
        for name in AUTO_ORDER:
            if name not in _REGISTRY:
                continue
            reason = _REGISTRY[name].unsupported(model, device)
            if reason is None:
                if reasons:
                    why = reasons[0][1] if len(reasons) == 1 else "; ".join(f"{n}: {r}" for n, r in reasons)
                    log(f"[openrlhf-div] rollout.backend=auto: sampling with {name} "
                        f"({_REGISTRY[name].description}): {why}")
                return name
            reasons.append((name, reason))
        raise BackendUnavailable("rollout.backend=auto: no sampler can run here ("
                                 + "; ".join(f"{n}: {r}" for n, r in reasons) + ")")
    spec = get_spec(requested)
    reason = spec.unsupported(model, device)
    if reason is not None:
        others = [n for n in backend_choices() if n != requested]
        raise BackendUnavailable(f"rollout.backend={requested} but {spec.label or requested} cannot sample here: "
                                 f"{reason}. Use rollout.backend={' or '.join(others)}", reason)
    return requested


def build_sampler(name: str, model, tokenizer, rollout_cfg, *, device, seed: int, fallback: Optional[str] = None,
                  log=print) -> Sampler:
    """Start backend ``name``. When it fails to start and ``fallback`` is given (``auto`` chose
    ``name``), ``fallback`` is started instead with one line saying why; otherwise the error
    propagates."""
    try:
        return get_spec(name).factory(model, tokenizer, rollout_cfg, device=device, seed=seed)
    except Exception as exc:  # noqa: BLE001 - auto falls back, an explicit backend does not
        if fallback is None or fallback == name:
            raise
        log(f"[openrlhf-div] rollout.backend=auto: the {name} sampler did not start ({type(exc).__name__}: "
            f"{str(exc)[:300]}); sampling with {fallback} ({get_spec(fallback).description})")
        return get_spec(fallback).factory(model, tokenizer, rollout_cfg, device=device, seed=seed)


def open_sampler(requested: str, model, tokenizer, rollout_cfg, *, device, seed: int, log=print) -> Sampler:
    """:func:`resolve_backend` then :func:`build_sampler` (``auto`` falls back on ``hf`` when the
    chosen engine does not start): the one call the trainer, pre-sampling and evaluation make."""
    name = resolve_backend(requested, model, device, log=log)
    return build_sampler(name, model, tokenizer, rollout_cfg, device=device, seed=seed,
                         fallback="hf" if requested == "auto" else None, log=log)


# ------------------------------------------------------------------------------ hf
class HFSampler:
    """The local KV-cache sampler (:func:`.generation.generate`) over the policy itself. It reads
    the policy's own parameters, so new weights need no push and there is nothing to free."""

    name = "hf"

    def __init__(self, model, tokenizer, decode_step: str = "dynamic"):
        self.model, self.tokenizer = model, tokenizer
        self.decode_step = decode_step   # rollout.decode_step: the lean decoder's token step
        self.awake = True
        self.push_seconds = 0.0
        self.start_seconds = 0.0

    def generate(self, prompts, **kw):
        from .generation import generate

        return generate(self.model, self.tokenizer, prompts, **{"decode_step": self.decode_step, **kw})

    def sync(self, model) -> None:
        self.model = model  # the same object in the trainer; a new one (eval of a loaded model) is taken as is
        self.push_seconds = 0.0

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass


def _hf_factory(model, tokenizer, rollout_cfg=None, *, device=None, seed: int = 0) -> HFSampler:
    return HFSampler(model, tokenizer, getattr(rollout_cfg, "decode_step", "dynamic"))


def _vllm_factory(model, tokenizer, rollout_cfg, *, device, seed: int):
    from .vllm_sampler import VLLMSampler

    r = rollout_cfg
    return VLLMSampler(model, tokenizer, device=device, seed=seed,
                       gpu_memory_utilization=r.vllm_gpu_memory_utilization, kv_cache_gb=r.vllm_kv_cache_gb,
                       enforce_eager=r.vllm_enforce_eager, sleep=r.vllm_sleep, seeding=r.vllm_seeding)


def _vllm_unsupported(model, device) -> Optional[str]:
    from .vllm_sampler import vllm_unsupported_reason

    return vllm_unsupported_reason(model, device)


register_sampler("hf", _hf_factory, description="the local KV-cache sampler")
register_sampler("vllm", _vllm_factory, unsupported=_vllm_unsupported,
                 description="an in-process vLLM engine", label="vLLM")


SamplerUnavailable = BackendUnavailable  # the registry's own name for it
