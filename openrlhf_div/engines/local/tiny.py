"""Tiny real Hugging Face models and tokenizers built on the spot (no model hub needed).

:func:`build_tiny_tokenizer` makes a genuine ``tokenizers`` tokenizer wrapped in
:class:`transformers.PreTrainedTokenizerFast`: every vocabulary item (single characters
or longer "word" tokens) is one token, matched longest-first; anything else maps to
``<unk>``. Decoding concatenates tokens (no spaces are inserted), so a character-level
vocabulary round-trips text exactly. :func:`build_tiny_model` makes a small Qwen2 causal
LM from a config. Both save with ``save_pretrained`` and load with ``from_pretrained``;
:func:`save_model` writes into a temporary directory and ``os.replace``-s it into place,
so a reader never sees a half-written model.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch

from openrlhf_div.io import apply_umask_modes_tree
from openrlhf_div.progress import quiet_library_bars

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def build_tiny_tokenizer(vocab: Union[str, Iterable[str]], model_max_length: int = 512):
    """A real HF fast tokenizer over ``vocab`` (a string of characters or a list of tokens).

    Special tokens ``<pad>`` (id 0), ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3) come first;
    the vocabulary items follow in the given order (duplicates dropped). Padding is on the
    left (what batched generation wants); ``add_special_tokens`` adds nothing, so prompts
    are encoded exactly as written.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    items = list(vocab) if isinstance(vocab, str) else [str(v) for v in vocab]
    seen, tokens = set(SPECIAL_TOKENS), []
    for t in items:
        if not t:
            raise ValueError("build_tiny_tokenizer: empty token in vocab")
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    if not tokens:
        raise ValueError("build_tiny_tokenizer: vocab is empty")
    table = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + tokens)}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token=UNK))
    # Longest-first alternation of the vocabulary, then any single character (-> <unk>).
    alternation = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
    pattern = f"{alternation}|[\\s\\S]"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="left", model_max_length=model_max_length,
    )
    return hf


def tiny_config(vocab_size: int, *, pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2,
                hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: Optional[int] = None, max_position_embeddings: int = 512,
                tie_word_embeddings: bool = True):
    """A :class:`transformers.Qwen2Config` for a tiny causal LM (sdpa attention)."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 2 * hidden_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        use_cache=True,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build_tiny_model(vocab: Union[str, Sequence[str]], *, seed: int = 0, hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: Optional[int] = None, max_position_embeddings: int = 512,
                     dtype: torch.dtype = torch.float32) -> Tuple[torch.nn.Module, object]:
    """``(model, tokenizer)``: a freshly initialised tiny Qwen2 causal LM and its tokenizer.

    The weights depend only on ``seed`` and the architecture (the global RNG is saved and
    restored, so calling this does not disturb other random streams).
    """
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer(vocab, model_max_length=max_position_embeddings)
    cfg = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                      max_position_embeddings=max_position_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    model.to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


quiet_hf_progress = quiet_library_bars  # noqa: E305 (the one helper: openrlhf_div.progress)


@contextlib.contextmanager
def no_deepspeed_autodetect():
    """Keep DeepSpeed's accelerator auto-detection quiet on a CPU-only local run.

    The local engine never uses DeepSpeed, but ``save_pretrained`` -> ``unwrap_model`` ->
    accelerate's ``extract_model_from_parallel`` imports it whenever it is installed, and its
    auto-detection then warns "Setting accelerator to CPU ... unable to detect" at the end of
    every run. With no GPU (CUDA or MPS) CPU is what DeepSpeed would pick anyway, so inside this
    context, when DeepSpeed is not loaded yet and ``DS_ACCELERATOR`` is unset, it is set to
    ``cpu`` (DeepSpeed's own override: same choice, no warning) and removed afterwards."""
    set_here = ("deepspeed" not in sys.modules and "DS_ACCELERATOR" not in os.environ
                and not torch.cuda.is_available()
                and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()))
    if set_here:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if set_here:
            os.environ.pop("DS_ACCELERATOR", None)


def _atomic_dir_write(path: str, write) -> str:
    """Run ``write(tmp_dir)`` then rename ``tmp_dir`` to ``path`` (replacing an old one)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        with quiet_hf_progress(), no_deepspeed_autodetect():
            write(tmp)
        # mkdtemp made the folder 0700 and save_pretrained writes its safetensors 0600: follow the umask
        apply_umask_modes_tree(tmp)
        old = None
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
            os.rmdir(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def save_model(model, tokenizer, path: str) -> str:
    """Save model + tokenizer with ``save_pretrained`` into ``path`` atomically
    (written to a temporary sibling directory, then renamed into place)."""
    def write(tmp):
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return _atomic_dir_write(path, write)


def load_model(path: str, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"):
    """``(model, tokenizer)`` from a directory written by :func:`save_model`, any Hugging Face
    causal LM folder, a ``.gguf`` file or a Hub id in the local cache
    (:func:`openrlhf_div.engines.local.models.load_pretrained`). The tokenizer pads on the left."""
    from .models import load_pretrained

    return load_pretrained(path, dtype=dtype, device=device)
