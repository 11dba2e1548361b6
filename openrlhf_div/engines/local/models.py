"""Where a model comes from: a Hugging Face model folder, a ``.gguf`` file, or a Hub id that
is already in the local Hugging Face cache (nothing is downloaded).

:func:`resolve_model` turns ``model.path`` / ``eval --model`` into ``(folder, gguf_file)``;
:func:`load_pretrained` loads model and tokenizer from it in the requested dtype, pads on
the left and gives the tokenizer a pad token when it has none (:mod:`.tokens`).
A GGUF file is de-quantized by transformers (it needs the ``gguf`` package); checkpoints
written afterwards are ordinary safetensors folders in the training dtype.
"""
from __future__ import annotations

import os
import re
from typing import Optional, Tuple, Union

import torch

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelNotFoundError(FileNotFoundError):
    """``model.path`` names nothing loadable here; the message says what is accepted."""


ACCEPTED = ("a Hugging Face model folder, a .gguf file, or a Hub id already in the local Hugging Face cache")


def resolve_model(path: str) -> Tuple[str, Optional[str]]:
    """``(folder, gguf_file or None)`` for a folder, a ``.gguf`` file or a cached Hub id."""
    p = os.path.expanduser(str(path))
    if os.path.isfile(p):
        if not p.lower().endswith(".gguf"):
            raise ModelNotFoundError(f"model {path!r} is a file but not a .gguf file; give {ACCEPTED}")
        return os.path.dirname(os.path.abspath(p)), os.path.basename(p)
    if os.path.isdir(p):
        if not os.path.exists(os.path.join(p, "config.json")):
            ggufs = sorted(f for f in os.listdir(p) if f.lower().endswith(".gguf"))
            if len(ggufs) == 1:
                return os.path.abspath(p), ggufs[0]
            hint = f" (it holds {', '.join(ggufs)}: pass one of them)" if ggufs else ""
            raise ModelNotFoundError(f"model folder {path!r} has no config.json{hint}; give {ACCEPTED}")
        return os.path.abspath(p), None
    if _HUB_ID.match(str(path)) and not str(path).startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError and friends
            home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
            raise ModelNotFoundError(
                f"model {path!r} is neither a local path nor in the local Hugging Face cache ({home}/hub); this "
                f"works offline only. Download it once where there is network (`huggingface-cli download {path}`, "
                f"then copy the cache or the folder here) or pass a local folder or .gguf file "
                f"({type(exc).__name__})") from None
        return folder, None
    raise ModelNotFoundError(f"model {path!r} does not exist; give {ACCEPTED} (model.path: null builds the tiny "
                             f"model from the model.tiny_* options)")


def load_tokenizer(folder: str, gguf_file: Optional[str] = None):
    """The tokenizer of a resolved model, padding on the left, with a pad token."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from .tokens import ensure_pad_token

    if gguf_file is None and os.path.exists(os.path.join(folder, "tokenizer.json")):
        # Not AutoTokenizer: transformers 5 maps a Qwen2 config to Qwen2Tokenizer, which swaps in
        # Qwen's own pre-tokenizer (it drops the tiny vocabulary's spaces). The generic fast class
        # keeps tokenizer.json as written.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file) if gguf_file else \
            AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    ensure_pad_token(tokenizer)
    return tokenizer


def load_pretrained(path: str, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"):
    """``(model, tokenizer)`` from a folder, a ``.gguf`` file or a cached Hub id, the model in
    ``dtype`` on ``device`` (sdpa attention)."""
    from transformers import AutoModelForCausalLM

    from .tiny import quiet_hf_progress

    folder, gguf = resolve_model(path)
    tokenizer = load_tokenizer(folder, gguf)
    kw = {"gguf_file": gguf} if gguf else {}
    with quiet_hf_progress():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa", **kw)
    model.to(device)
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
