"""vLLM as the local engine's sampler (``rollout.backend: vllm``): one in-process engine next to
the trainer, colocated on the same CPU or GPU, the layout TRL's ``vllm_mode="colocate"`` and
verl's hybrid engine use.

* **One process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` puts vLLM's engine core and its single
  worker in this process (no spawned EngineCore), so the worker's model is a Python object here
  and weights reach it by reference (no broadcast, no serialisation).
* **No second copy on disk.** The engine starts from the policy's ``config.json`` only
  (``load_format="dummy"``, ``skip_tokenizer_init=True``: prompts go in as token ids, responses
  are decoded by the trainer's tokenizer) and gets the trainer's weights pushed right away.
* **Weights after every optimizer step** go through :func:`push_weights`, the one place that
  writes into vLLM: :func:`openrlhf_div.compat.vllm_weights.update_vllm_weights` (vLLM's
  layer-wise reload, which re-packs the CPU GEMM weights under every dispatch).
* **Memory.** On a GPU the engine takes ``rollout.vllm_gpu_memory_utilization`` of the card and
  sleeps between rollouts (``enable_sleep_mode``; level 2: KV cache and weights dropped, the
  weights come back with the next push); on a CPU the KV cache is ``rollout.vllm_kv_cache_gb``.
* **Same seed, same samples.** The seeds come from the caller's ``torch.Generator`` (whose state
  checkpoints save, as with ``hf``). ``seeding="batch"`` (default): one seed per call seeds the
  RNG vLLM's batched sampler draws from (in this process: torch's default generator, saved and
  restored around the call, so the trainer's own random state is untouched), and the prefix
  cache is reset first so that the schedule, and with it the random stream, repeats.
  ``seeding="request"``: every sample is its own request with its own seed, so a sample depends on
  its seed alone - but vLLM then draws the noise row by row outside its compiled sampler
  (~1.4x the time per generated token on SmolLM2 on this CPU, docs/benchmarks.md "Samplers").
* **Log-probs.** ``logprobs_mode="processed_logprobs"``: the sampled token's log-prob under
  ``softmax(logits / T)``, the distribution the trainer's forward scores (greedy: ``T = 1``).
  With ``top_p < 1`` vLLM's processed log-probs are renormalised over the nucleus, unlike the
  ``hf`` sampler's; the config refuses ``recompute_old_log_probs: false`` there.

:func:`vllm_unsupported_reason` is the ``vllm`` entry's check in the sampler registry
(:mod:`.sampler_registry`, which also decides ``auto``); it rules vLLM out without importing it
when a cheap check suffices.
"""
from __future__ import annotations

import copy
import importlib.util
import logging
import os
import random
import sys
import tempfile
import time
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch

# head sizes of vLLM 0.29's CPU attention kernel (vllm/v1/attention/backends/cpu_attn.py); a cheap
# pre-check so that `auto` on the demo's tiny models (head size 16) does not import vLLM (10-20 s)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _head_dim(config) -> int:
    hd = getattr(config, "head_dim", None)
    return int(hd) if hd else int(config.hidden_size) // int(config.num_attention_heads)


def vllm_unsupported_reason(model, device: Union[str, torch.device], *, check_registry: bool = True) -> Optional[str]:
    """Why vLLM cannot sample for ``model`` on ``device`` (None: it can). Cheap checks first
    (installed, LoRA, head size on CPU); only then is vLLM imported for its model registry."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return "vllm is not installed"
    if "vllm" in sys.modules and getattr(sys.modules["vllm"], "__version__", "").endswith("openrlhf_div.stub"):
        return "vllm is the CPU import stub (openrlhf_div.compat.vllm_stub), not the package"
    if hasattr(model, "peft_config"):
        return "the policy has LoRA adapters (model.lora_rank > 0); the vLLM sampler takes full weights"
    cfg = model.config
    archs = list(getattr(cfg, "architectures", None) or [type(model).__name__])
    dev = torch.device(device)
    if dev.type == "cpu":
        hd = _head_dim(cfg)
        if hd not in CPU_HEAD_SIZES:
            return (f"head size {hd} is not one vLLM's CPU attention supports ({', '.join(map(str, CPU_HEAD_SIZES))});"
                    f" e.g. a tiny model with model.tiny_hidden_size / model.tiny_heads = 32 or 64")
    elif dev.type != "cuda":
        return f"device {dev} (vLLM runs on cpu or cuda)"
    if check_registry:
        try:
            from vllm.model_executor.models.registry import ModelRegistry
        except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
            return f"vllm does not import ({type(exc).__name__}: {exc})"
        supported = set(ModelRegistry.get_supported_archs())
        if not any(a in supported for a in archs):
            return f"architecture {archs[0]} is not in vLLM's model registry"
    return None


# ------------------------------------------------------------------------------------ weights
def push_weights(vllm_model: torch.nn.Module, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """Write HF-named ``weights`` into vLLM's model in place: the one weight path into vLLM of the
    local engine, :func:`openrlhf_div.compat.vllm_weights.update_vllm_weights` (vLLM's layer-wise
    reload; re-packs the CPU GEMM weights under every dispatch and the tied ``lm_head``; a plain
    ``load_weights`` on this AVX2 machine's oneDNN dispatch fails or leaves the tied head stale)."""
    from openrlhf_div.compat.vllm_weights import update_vllm_weights

    update_vllm_weights(vllm_model, weights)


def _hf_weights(model) -> List[Tuple[str, torch.Tensor]]:
    """The policy's parameters under their Hugging Face names, detached (no copy)."""
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _config_dir(cfg) -> str:
    """A folder holding only ``cfg``'s ``config.json``, at a path fixed by its content
    (``~/.cache/openrlhf_div/vllm_models/<hash>``): vLLM's compile cache is keyed by the model
    path among other things, so a fresh temporary folder per start could never hit it (vLLM 0.29's
    CPU build then needs :mod:`openrlhf_div.compat.vllm_aot_cache` to load what it finds).
    ``_name_or_path`` (where the weights were read from) is left out: the engine loads no weights
    (``load_format="dummy"``), and the same model reached by another path (another venv, another
    copy of the GGUF file) must find the same compiled graph (issue 32: a second process on the
    same host compiled SmolLM2 again, 112.6 s instead of 15.3 s, for this field alone)."""
    import hashlib
    import json

    data = json.loads(cfg.to_json_string(use_diff=False))
    data.pop("_name_or_path", None)
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(root, "openrlhf_div", "vllm_models", hashlib.sha256(text.encode()).hexdigest()[:20])
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: a concurrent start reads a whole file
    return folder


# ------------------------------------------------------------------------------------ sampler
class _QuietExpected(logging.Filter):
    """Drops two warnings vLLM logs for every in-process engine here that say nothing wrong: the
    chat-template warm-up's traceback (there is no tokenizer: ``skip_tokenizer_init``, prompts
    arrive as ids) and the CPU worker refusing ``torch.set_num_threads`` during start-up (the
    trainer's thread count is put back right after, see ``VLLMSampler.__init__``)."""

    LOGGERS = ("vllm.renderers.base", "vllm.v1.worker.cpu_worker")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Chat template warmup failed") or "after the thread binding" in msg)

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)
        return False


class VLLMSampler:
    """An in-process ``vllm.LLM`` that samples for ``model`` (a Hugging Face causal LM); the
    ``vllm`` entry of :mod:`.sampler_registry` (its :class:`~.sampler_registry.Sampler` protocol)."""

    name = "vllm"

    def __init__(self, model, tokenizer, *, device: Union[str, torch.device] = "cpu", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, kv_cache_gb: Optional[float] = 1.0,
                 enforce_eager: bool = False, sleep: bool = True, max_model_len: Optional[int] = None,
                 seeding: str = "batch"):
        if seeding not in ("batch", "request"):
            raise ValueError(f"seeding must be batch or request, got {seeding!r}")
        self.seeding = seeding
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # do not pin the trainer's threads
        from .tokens import ensure_pad_token, stop_token_ids

        ensure_pad_token(tokenizer)
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        cfg = copy.deepcopy(model.config)
        if not getattr(cfg, "architectures", None):  # a model built from a config names no class
            cfg.architectures = [type(model).__name__]
        self._model_dir = _config_dir(cfg)  # the architecture only; weights are pushed
        ctx = int(max_model_len or getattr(cfg, "max_position_embeddings", 2048))
        on_gpu = self.device.type == "cuda"
        self.sleeps = bool(sleep and on_gpu)  # vLLM's CPU worker has no sleep mode
        kw = dict(model=self._model_dir, skip_tokenizer_init=True, load_format="dummy",
                  dtype=str(self.dtype).replace("torch.", ""), seed=int(seed), max_model_len=ctx,
                  enforce_eager=bool(enforce_eager), logprobs_mode="processed_logprobs",
                  gpu_memory_utilization=float(gpu_memory_utilization), enable_sleep_mode=self.sleeps)
        if not on_gpu and kv_cache_gb:
            kw["kv_cache_memory_bytes"] = int(float(kv_cache_gb) * 2**30)
        # vLLM's CPU worker replaces torch.set_num_threads for the whole process and seeds the
        # global RNGs: keep the trainer's thread count, function and random state as they were
        set_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
        rng = (torch.get_rng_state(), random.getstate())
        import numpy as np

        np_rng = np.random.get_state()
        t0 = time.perf_counter()
        if not enforce_eager:
            from openrlhf_div.compat.vllm_aot_cache import allow_inductor_aot_reload

            allow_inductor_aot_reload()  # vLLM 0.29's CPU build could not reload its compiled graph
            print("[openrlhf-div] vLLM sampler: compiled engine - the first start on this machine compiles the model "
                  "graph (torch.compile; minutes on a CPU, SmolLM2-135M ~1-3 min on 2 cores), later starts of the "
                  "same model load it from vLLM's compile cache; rollout.vllm_enforce_eager=true skips both",
                  flush=True)
        from vllm import LLM

        try:
            with _QuietExpected():
                self.llm = LLM(**kw)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(n_threads)
            torch.set_rng_state(rng[0])
            random.setstate(rng[1])
            np.random.set_state(np_rng)
        self.start_seconds = time.perf_counter() - t0
        self.awake = True
        self.push_seconds = 0.0
        self.sync(model)

    # -------------------------------------------------------------- weights and memory
    def _worker_call(self, fn, *args):
        return self.llm.collective_rpc(fn, args=args)[0]

    def sync(self, model) -> None:
        """Push ``model``'s current weights into the engine (after every optimizer step)."""
        t0 = time.perf_counter()
        if self.sleeps and not self.awake:
            self.llm.wake_up(tags=["weights"])
        weights = _hf_weights(model)
        self._worker_call(lambda w, ws: push_weights(w.model_runner.model, ws), weights)
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights
        if self.sleeps and not self.awake:
            self.llm.wake_up(tags=["kv_cache"])
            self.awake = True
        self.push_seconds = time.perf_counter() - t0

    def sleep(self) -> None:
        """GPU: free the KV cache and the weights (level 2) while the trainer runs."""
        if self.sleeps and self.awake:
            self.llm.sleep(level=2)
            self.awake = False

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            self.llm = None

    # -------------------------------------------------------------- sampling
    @torch.no_grad()
    def generate(self, prompts: Sequence[Union[str, Sequence[int]]], *, n_samples: int = 1,
                 max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, batch_size: Optional[int] = None,
                 stop_ids: Optional[Sequence[int]] = None):
        """Same contract and output as :func:`.generation.generate` (one row per sample, rows of
        a prompt contiguous). ``batch_size`` is ignored: vLLM schedules its own batches."""
        from vllm import SamplingParams

        from .generation import GenerationOutput, check_sampling_args, encode_prompts, pack_sequences

        check_sampling_args(n_samples, max_new_tokens, top_p)
        if getattr(self, "llm", None) is None:
            raise RuntimeError("the vLLM sampler was closed (Trainer.close_sampler); build a new Trainer")
        if self.sleeps and not self.awake:
            raise RuntimeError("VLLMSampler.generate while asleep: call sync(model) first")
        rows = [p for p in encode_prompts(self.tokenizer, prompts) for _ in range(n_samples)]
        greedy = temperature is None or temperature <= 0
        dev = generator.device if generator is not None else torch.device("cpu")
        stops = [int(s) for s in (self.stop_ids if stop_ids is None else stop_ids)]

        def params(seed=None):
            return SamplingParams(n=1, max_tokens=int(max_new_tokens), temperature=0.0 if greedy else float(temperature),
                                  top_p=1.0 if greedy else float(top_p), seed=seed, logprobs=0, stop_token_ids=stops,
                                  ignore_eos=False, detokenize=False, skip_special_tokens=False)

        requests = [{"prompt_token_ids": list(r)} for r in rows]
        if self.seeding == "request":
            seeds = torch.randint(0, 2**31 - 1, (len(rows),), generator=generator, device=dev).tolist()
            outs = self.llm.generate(requests, [params(int(s)) for s in seeds], use_tqdm=False)
        else:
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=dev))
            self.llm.reset_prefix_cache()  # same cache state -> same schedule -> same random stream
            # vLLM's batched sampler (in this process) draws from torch's default generator(s):
            # seed them for the call, the caller's state comes back afterwards
            cuda = [self.device.index or 0] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                torch.manual_seed(seed)
                outs = self.llm.generate(requests, params(), use_tqdm=False)
        resp, lps, finished = [], [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            resp.append(ids)
            lps.append([float(d[t].logprob) for d, t in zip(c.logprobs or [], ids)])
            finished.append(c.finish_reason == "stop")
        pad_id = self.tokenizer.pad_token_id
        ids, attn, rmask = pack_sequences(rows, resp, pad_id, "cpu")
        lp = torch.zeros(rmask.shape, dtype=torch.float32)
        for i, r in enumerate(lps):
            lp[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
        texts = self.tokenizer.batch_decode(resp, skip_special_tokens=True)
        dev_out = self.device
        return GenerationOutput(ids.to(dev_out), attn.to(dev_out), rmask.to(dev_out), lp.to(dev_out),
                                [list(r) for r in rows], resp, texts,
                                torch.tensor(finished, dtype=torch.bool, device=dev_out))
