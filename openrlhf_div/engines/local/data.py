"""The local engine's side of the one data layer.

Training, pre-sampling and periodic evaluation read user data through
:func:`openrlhf_div.tasks.datasets.load_examples` (the loader ``openrlhf-div eval`` uses):
JSONL / JSON / Parquet files and ``save_to_disk`` folders, the usual layouts detected
(GSM8K ``####``, MATH ``\\boxed{}``, Countdown, BIRD / Spider), field names from the
``data`` section of the config, a missing label or a wrong field type an error naming file
and line, duplicate ids an error naming both lines. :func:`prepare_prompts` then renders
(``data.prompt_template`` / ``data.system_prompt``) and tokenizes every prompt once and
refuses one longer than ``data.max_prompt_tokens``, again naming file and line. The seeded
stream over prompts is :class:`~openrlhf_div.engines.anchor_data.Cursor` (the anchor sampler).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from openrlhf_div.engines.anchor_data import Cursor  # noqa: F401 (the seeded stream over prompts and anchors)
from openrlhf_div.tasks.datasets import DatasetError, LoadSummary, load_examples as _load_examples, render_example

# a token is rarely longer than this many characters: prompts longer than
# max_prompt_tokens * _CHARS_PER_TOKEN_MAX are refused before tokenizing them
_CHARS_PER_TOKEN_MAX = 64


#: the options ``openrlhf-div train`` has for what a data error points to (it skips no malformed row)
DATA_HINTS = {"on_error": None, "duplicate_ids": "data.duplicate_ids=rename", "max_prompt": "data.max_prompt_tokens"}


def load_task_examples(cfg, path: str, split: Optional[str] = None, normalized: bool = False,
                       max_prompt_chars: Optional[int] = None) -> Tuple[List[Dict[str, Any]], LoadSummary]:
    """Examples of ``path`` for ``cfg.task`` with the ``data`` section's field mapping.

    ``normalized=True`` for files this project wrote (pre-sampling's ``d_exp.jsonl``): rows
    are already ``{prompt, label, source, id, ...}`` and are taken as they are."""
    d = cfg.data
    if normalized:
        ex, summary = _load_examples(path, "__normalized__", duplicate_ids=d.duplicate_ids,
                                     max_prompt_chars=max_prompt_chars, hints=DATA_HINTS)
    else:
        ex, summary = _load_examples(path, cfg.task, split=split, prompt_field=d.prompt_field,
                                     label_field=d.label_field, id_field=d.id_field, duplicate_ids=d.duplicate_ids,
                                     max_prompt_chars=max_prompt_chars, hints=DATA_HINTS)
    if not ex:
        raise DatasetError(f"data file {path!r} holds no examples")
    return ex, summary


def example_key(example: Dict[str, Any]) -> Tuple[str, str]:
    """What identifies an example (its prompt cache key): ``(source, id)``, unique per load."""
    return str(example.get("source")), str(example["id"])


def render_prompt(task, tokenizer, example: Dict[str, Any], data_cfg=None) -> str:
    """The prompt text of an example (:func:`openrlhf_div.tasks.datasets.render_example`, with
    ``data.prompt_template`` / ``data.system_prompt`` when a data config is given)."""
    if data_cfg is None:
        return task.render_prompt(example, tokenizer)
    return render_example(task, tokenizer, example, data_cfg.prompt_template, data_cfg.system_prompt,
                          chat_template=getattr(data_cfg, "chat_template", True))


def max_prompt_tokens(cfg, model, max_new_tokens: int) -> Optional[int]:
    """``data.max_prompt_tokens``, else the model's context length minus the response length."""
    if cfg.data.max_prompt_tokens is not None:
        return int(cfg.data.max_prompt_tokens)
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(ctx) - int(max_new_tokens) if ctx else None


def prepare_prompts(task, tokenizer, examples: Sequence[Dict[str, Any]], summary: Optional[LoadSummary], data_cfg,
                    max_tokens: Optional[int], texts_out: Optional[Dict[Tuple[str, str], str]] = None
                    ) -> Dict[Tuple[str, str], List[int]]:
    """Render and tokenize every prompt once: ``{example_key: token ids}`` (the rendered texts
    go into ``texts_out`` when given). A prompt longer than ``max_tokens`` is a
    :class:`DatasetError` naming its file and line."""
    from .generation import encode_prompts

    out: Dict[Tuple[str, str], List[int]] = {}
    for ex in examples:
        key = example_key(ex)
        where = (summary.locations.get(str(ex["id"])) if summary is not None else None) or f"example {ex['id']!r}"
        try:
            text = render_prompt(task, tokenizer, ex, data_cfg)
        except Exception as exc:  # noqa: BLE001 - name the row
            raise DatasetError(f"{where}: cannot build the prompt ({type(exc).__name__}: {exc})") from exc
        if max_tokens is not None and len(text) > max_tokens * _CHARS_PER_TOKEN_MAX:
            raise DatasetError(f"{where}: prompt of {len(text):,} characters cannot fit data.max_prompt_tokens="
                               f"{max_tokens}; shorten or drop it")
        ids = encode_prompts(tokenizer, [text])[0]
        if max_tokens is not None and len(ids) > max_tokens:
            raise DatasetError(f"{where}: prompt is {len(ids)} tokens, more than data.max_prompt_tokens={max_tokens} "
                               f"(default: the model's context minus the response length); shorten or drop it, "
                               f"or raise data.max_prompt_tokens")
        out[key] = ids
        if texts_out is not None:
            texts_out[key] = text
    return out


def data_fingerprint(path: str) -> str:
    """First 16 hex digits of a SHA-256 over a file's bytes, or over a folder's files (relative
    names and bytes, in sorted order)."""
    h = hashlib.sha256()
    if os.path.isdir(path):
        for dp, dns, fns in sorted(os.walk(path)):
            dns.sort()
            for fn in sorted(fns):
                fp = os.path.join(dp, fn)
                h.update(os.path.relpath(fp, path).encode() + b"\0")
                with open(fp, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
    else:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]
