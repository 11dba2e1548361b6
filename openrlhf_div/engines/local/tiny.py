"""Tiny real Hugging Face models and tokenizers built on the spot (no model hub needed).

:func:`build_tiny_tokenizer` makes a genuine ``tokenizers`` tokenizer wrapped in
:class:`transformers.PreTrainedTokenizerFast`: every vocabulary item (single characters
or longer "word" tokens) is one token, matched longest-first; anything else maps to
``<unk>``. Decoding concatenates tokens (no spaces are inserted), so a character-level
vocabulary round-trips text exactly. :func:`build_tiny_model` makes a small Qwen2 causal
LM from a config. Saving and loading (any model, tiny or not) is :mod:`.models`
(:func:`~.models.save_model`, :func:`~.models.load_model`).
"""
from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch


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
