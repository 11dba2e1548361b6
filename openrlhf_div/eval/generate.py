"""Sampling for evaluation: Hugging Face ``model.generate`` in-process, or vLLM when installed.

Both return the same schema: ``outputs[i]`` is the list of ``n`` decoded completions (prompt
removed, special tokens skipped) for ``prompts[i]``. :func:`make_generate_fn` binds a model to
the ``generate_fn(prompts, n=, temperature=, top_p=, max_new_tokens=, greedy=)`` callable that
:func:`openrlhf_div.eval.evaluate.evaluate` takes, so any engine can be plugged in.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ["generate", "generate_vllm", "make_generate_fn", "vllm_available", "GenerateFn"]

GenerateFn = Callable[..., List[List[str]]]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _needs_special_tokens(tokenizer, prompts) -> bool:
    """Add the tokenizer's special tokens (a BOS) unless the prompts already start with it,
    as a chat template's output does -- no missing and no doubled BOS."""
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and all(p.startswith(bos) for p in prompts))


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
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    out: List[List[str]] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            enc = tokenizer(chunk, return_tensors="pt", padding=True,
                            add_special_tokens=_needs_special_tokens(tokenizer, chunk)).to(device)
            kw = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            if tokenizer.eos_token_id is not None:
                kw["eos_token_id"] = tokenizer.eos_token_id
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
            for i in range(len(chunk)):
                group = texts[i * reps:(i + 1) * reps]
                out.append(group * n if greedy else group)
    finally:
        tokenizer.padding_side = old_side
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
        add = _needs_special_tokens(tokenizer, prompts)
        inputs = [{"prompt_token_ids": tokenizer(p, add_special_tokens=add)["input_ids"]} for p in prompts]
    else:
        inputs = list(prompts)
    results = llm.generate(inputs, params, use_tqdm=False)
    out = []
    for r in results:
        texts = [o.text for o in r.outputs]
        out.append(texts * n if greedy else texts)
    return out


def make_generate_fn(model_path: str, engine: str = "auto", device: str = "auto", dtype: str = "auto",
                     batch_size: int = 8, seed: Optional[int] = None, trust_remote_code: bool = False,
                     ) -> Tuple[GenerateFn, Any, str]:
    """Load ``model_path`` and return ``(generate_fn, tokenizer, engine_name)``.

    ``engine``: ``"vllm"``, ``"hf"`` or ``"auto"`` (vLLM when importable, else Hugging Face).
    ``device`` (HF only): ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``; ``dtype``:
    ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"float32"``, ``"bfloat16"``, ``"float16"``.
    """
    from transformers import AutoTokenizer

    if engine not in ("auto", "hf", "vllm"):
        raise ValueError(f"engine must be 'auto', 'hf' or 'vllm', got {engine!r}")
    use_vllm = engine == "vllm" or (engine == "auto" and vllm_available())
    if engine == "vllm" and not vllm_available():
        raise RuntimeError("engine='vllm' but vllm is not installed; use --engine hf")
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if use_vllm:
        from vllm import LLM

        llm = LLM(model=model_path, dtype=dtype if dtype != "auto" else "auto", seed=seed or 0,
                  trust_remote_code=trust_remote_code)

        def fn(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=512, greedy=False):
            return generate_vllm(llm, prompts, n, temperature, top_p, max_new_tokens, greedy, seed=seed,
                                 tokenizer=tokenizer)

        return fn, tokenizer, "vllm"

    import torch
    from transformers import AutoModelForCausalLM

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        try:
            torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        except KeyError:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}") from None
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype,
                                                 trust_remote_code=trust_remote_code).to(device)
    if seed is not None:
        torch.manual_seed(seed)

    def fn(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=512, greedy=False):
        return generate(model, tokenizer, prompts, n=n, temperature=temperature, top_p=top_p,
                        max_new_tokens=max_new_tokens, greedy=greedy, batch_size=batch_size)

    return fn, tokenizer, "hf"
