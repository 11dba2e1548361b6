"""Real tokenizers, handled the same way in every path (train, presample, eval).

* **Padding**: a tokenizer without a pad token (most Llama / Mistral / GPT-2 style models)
  pads with its EOS token, else its UNK token, with one warning
  (:func:`ensure_pad_token`). Padding positions always have attention 0, so the choice only
  has to be a valid id.
* **Stopping**: generation stops on every id of ``generation_config.eos_token_id`` (an id
  or a list: Llama-3-Instruct's ``<|eot_id|>``, Qwen2.5's several end ids) plus the
  tokenizer's EOS (:func:`stop_token_ids`).
* **BOS**: a prompt gets the tokenizer's BOS exactly when the tokenizer itself adds one
  with ``add_special_tokens=True`` and the text does not already start with it (a chat
  template's output often does): no missing and no doubled BOS (:func:`encode_text`).
"""
from __future__ import annotations

import logging
from typing import List, Sequence

logger = logging.getLogger(__name__)


def ensure_pad_token(tokenizer) -> None:
    """Give ``tokenizer`` a pad token when it has none (EOS, else UNK), warning once per tokenizer."""
    if getattr(tokenizer, "pad_token_id", None) is not None:
        return
    for name in ("eos_token", "unk_token"):
        tok = getattr(tokenizer, name, None)
        if tok is not None:
            tokenizer.pad_token = tok
            logger.warning("the tokenizer has no pad token; padding with its %s %r (padding is masked out)",
                           name.replace("_token", "").upper(), tok)
            return
    raise ValueError("the tokenizer has no pad, EOS or UNK token to pad with; set tokenizer.pad_token")


def _ids(value) -> List[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def stop_token_ids(model, tokenizer) -> List[int]:
    """Every id that ends a response: ``generation_config.eos_token_id`` (id or list), the
    model config's ``eos_token_id`` when there is no generation config, and the tokenizer's EOS."""
    ids: List[int] = []
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(gen, "eos_token_id", None) is not None:
        ids += _ids(gen.eos_token_id)
    else:
        ids += _ids(getattr(getattr(model, "config", None), "eos_token_id", None))
    ids += _ids(getattr(tokenizer, "eos_token_id", None))
    out: List[int] = []
    for i in ids:
        if i not in out:
            out.append(i)
    if not out:
        raise ValueError("neither the model's generation config nor the tokenizer names an EOS token; responses "
                         "would only stop at max_new_tokens")
    return out


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts a BOS in front with ``add_special_tokens=True`` (cached)."""
    cached = getattr(tokenizer, "_openrlhf_div_adds_bos", None)
    if cached is not None:
        return cached
    bos = getattr(tokenizer, "bos_token_id", None)
    ans = False
    if bos is not None:
        with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
        without = tokenizer("a", add_special_tokens=False)["input_ids"]
        ans = bool(with_special) and with_special[0] == bos and (not without or without[0] != bos)
    try:
        tokenizer._openrlhf_div_adds_bos = ans
    except AttributeError:  # pragma: no cover - slotted tokenizers
        pass
    return ans


def encode_text(tokenizer, text: str) -> List[int]:
    """Token ids of a prompt: the text without special tokens, with the BOS in front when the
    tokenizer adds one and the text does not start with it already."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if adds_bos(tokenizer):
        bos_tok = tokenizer.bos_token
        if not (bos_tok and text.startswith(bos_tok)):
            ids = [int(tokenizer.bos_token_id)] + ids
    return ids


def encode_texts(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    return [encode_text(tokenizer, t) for t in texts]
