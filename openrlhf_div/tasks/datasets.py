"""Offline dataset loaders: JSONL / JSON / Parquet files and saved Hugging Face ``datasets``
folders, normalised to ``{"prompt", "label", "source", "id"}`` (plus task extras).

Field names are found automatically for the usual layouts and can be overridden:

======================  ===========================================  =========================
dataset                 question field                               answer / label field
======================  ===========================================  =========================
DAPO-Math-17k (parquet) ``prompt`` (chat list; DAPO wrapper removed)  ``reward_model.ground_truth``
MATH500, AIME24/25      ``problem`` / ``Problem``                     ``answer`` / ``Answer``
AMC23, College Math     ``question``                                  ``answer``
OlympiadBench           ``question``                                  ``final_answer`` (a list)
Minerva                 ``problem``                                   ``answer``, else ``\\boxed{}``
                                                                      in ``solution``
BIRD                    ``question`` + ``evidence``, ``db_id``        ``SQL``
Spider                  ``question``, ``db_id``                       ``query``
Countdown (TinyZero)    --                                            ``target``, ``nums``
======================  ===========================================  =========================

Malformed rows (bad JSON, missing fields) raise :class:`DatasetError` naming the file and the
line or row (``on_error="raise"``, the default) or are skipped and counted in the returned
:class:`LoadSummary` with their reasons (``on_error="skip"``) -- never dropped silently.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

__all__ = ["DatasetError", "LoadSummary", "load_examples", "read_records", "normalize_record"]

logger = logging.getLogger(__name__)

MATH_PROMPT_FIELDS = ("problem", "question", "Problem", "Question", "prompt", "input", "query")
MATH_LABEL_FIELDS = ("answer", "Answer", "final_answer", "gt_answer", "ground_truth", "reward_model.ground_truth",
                     "expected_answer", "gt", "label", "target")
SQL_QUESTION_FIELDS = ("question", "prompt", "input")
SQL_GOLD_FIELDS = ("SQL", "sql", "query", "gold_sql", "gold")
ID_FIELDS = ("id", "idx", "unique_id", "ID", "question_id", "problem_id", "extra_info.index", "index")
_GENERIC_STEMS = {"test", "train", "dev", "validation", "val", "data", "default", "eval"}
_DAPO_PREFIX = re.compile(r"^Solve the following math problem step by step\..*?answer to the problem\.\s*", re.DOTALL)
_DAPO_SUFFIX = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")


class DatasetError(ValueError):
    """A dataset file or row could not be read; the message names the file and line/row."""


@dataclass
class LoadSummary:
    path: str
    loaded: int = 0
    skipped: int = 0
    errors: List[str] = field(default_factory=list)  # one per skipped row (first 100 kept)
    renamed_ids: int = 0
    locations: Dict[str, str] = field(default_factory=dict, repr=False)  # example id -> "file:line"

    def __str__(self) -> str:
        s = f"{self.path}: loaded {self.loaded}"
        if self.skipped:
            s += f", skipped {self.skipped} malformed row(s), e.g. {self.errors[0]}"
        if self.renamed_ids:
            s += f", renamed {self.renamed_ids} duplicate id(s)"
        return s


# --------------------------------------------------------------------------- reading
def _is_hf_saved(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def read_records(path: str, split: Optional[str] = None) -> Iterator[Tuple[str, Any]]:
    """Yield ``(location, record)`` where ``location`` is ``"file:line"`` / ``"file row i"``;
    a record that cannot be decoded is yielded as a :class:`DatasetError` instance (so the
    caller decides between raising and skipping)."""
    if not os.path.exists(path):
        raise DatasetError(f"dataset not found: {path}")
    if os.path.isdir(path):
        if _is_hf_saved(path):
            yield from _read_hf_saved(path, split)
            return
        files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs
                       if f.endswith((".jsonl", ".json", ".parquet", ".ndjson")))
        if not files:
            raise DatasetError(f"{path}: a folder with no .jsonl/.json/.parquet files and no saved Hugging Face "
                               f"dataset (dataset_info.json/state.json)")
        for f in files:
            yield from read_records(f, split)
        return
    low = path.lower()
    if low.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from exc
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001
            raise DatasetError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from exc
        for i, row in enumerate(rows):
            yield f"{path} row {i}", row
        return
    if low.endswith((".jsonl", ".ndjson", ".json")):
        with open(path, encoding="utf-8") as fh:
            head = fh.read(4096).lstrip()
        if low.endswith(".json") and head.startswith("["):
            try:
                with open(path, encoding="utf-8") as fh:
                    rows = json.load(fh)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg}, column {exc.colno})") from exc
            for i, row in enumerate(rows):
                yield f"{path}[{i}]", row
            return
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as exc:
                    yield f"{path}:{lineno}", DatasetError(
                        f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})")
        return
    raise DatasetError(f"{path}: unsupported dataset format; use .jsonl, .json, .parquet or a saved "
                       f"Hugging Face dataset folder")


def _read_hf_saved(path: str, split: Optional[str]) -> Iterator[Tuple[str, Any]]:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover
        raise DatasetError(f"{path}: reading a saved Hugging Face dataset needs `datasets`") from exc
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        if split is None and len(splits) == 1:
            split = splits[0]
        if split is None:
            raise DatasetError(f"{path} is a DatasetDict with splits {', '.join(splits)}: name one (data.split / "
                               f"data.eval_split in a config, --split for eval)")
        if split not in ds:
            raise DatasetError(f"{path}: no split {split!r} (available: {', '.join(splits)})")
        ds = ds[split]
    elif split is not None:
        logger.info("%s is a single Dataset; split=%r ignored", path, split)
    for i, row in enumerate(ds):
        yield f"{path} row {i}", row


# --------------------------------------------------------------------------- normalising
def _get(row: Dict[str, Any], key: str) -> Any:
    """``row[key]`` with dotted paths into nested dicts (``reward_model.ground_truth``)."""
    cur: Any = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _first(row: Dict[str, Any], keys: Sequence[str]) -> Tuple[Optional[str], Any]:
    for k in keys:
        v = _get(row, k)
        if v is not None and v != "":
            return k, v
    return None, None


def _text_of(v: Any) -> str:
    """A prompt field's text: strings as is; chat lists -> the last user message's content."""
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)) and v and all(isinstance(m, dict) for m in v):
        users = [m for m in v if m.get("role") == "user"] or list(v)
        content = users[-1].get("content", "")
        if not isinstance(content, str):
            raise ValueError(f"chat message content holds a {type(content).__name__}, expected text")
        return content
    raise ValueError(f"prompt field holds a {type(v).__name__} ({_short(v)}), expected text or chat messages")


def _short(v: Any, n: int = 40) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


_LABEL_TYPES = (str, int, float, bool, dict, list)


def _strip_dapo(text: str) -> str:
    stripped = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text))
    return stripped.strip() if stripped != text else text


def _answer_text(v: Any) -> str:
    """An answer field's final answer: lists joined by ", ", integral floats as integers, and a
    GSM8K rationale ``"... #### 1,234"`` cut to what follows ``####`` (thousands commas removed)."""
    if isinstance(v, (list, tuple)):
        if not v:
            raise ValueError("the answer list is empty")
        return ", ".join(_answer_text(x) for x in v)
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ValueError(f"the answer field holds a {type(v).__name__}, expected text or a number")
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    text = str(v).strip()
    if "####" in text:
        final = text.rsplit("####", 1)[1].strip()
        if not final:
            raise ValueError("GSM8K-style answer with nothing after '####'")
        if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", final):
            final = final.replace(",", "")
        return final
    return text


def _need(row, keys, what, override):
    if override:
        v = _get(row, override)
        if v is None or v == "":
            raise ValueError(f"missing field {override!r} ({what}); fields present: {sorted(row)}")
        return override, v
    k, v = _first(row, keys)
    if k is None:
        raise ValueError(f"no {what} field (looked for {', '.join(keys)}); fields present: {sorted(row)}. "
                         f"Name it with the matching *_field option")
    return k, v


def normalize_record(row: Any, task: str, *, prompt_field: Optional[str] = None, label_field: Optional[str] = None,
                     strip_instructions: bool = True) -> Dict[str, Any]:
    """One raw row -> ``{"prompt", "label", ...task extras}`` (no source/id yet). Raises
    ``ValueError`` with a readable reason on a malformed row."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object per row, got {type(row).__name__}")
    if task == "math":
        _, p = _need(row, MATH_PROMPT_FIELDS, "question", prompt_field)
        prompt = _text_of(p)
        if strip_instructions:
            prompt = _strip_dapo(prompt)
        try:
            _, a = _need(row, MATH_LABEL_FIELDS, "answer", label_field)
            label = _answer_text(a)
        except ValueError:
            sol = _get(row, "solution")
            if label_field is None and isinstance(sol, str):
                from .math import find_boxed

                boxed = find_boxed(sol)
                if not boxed:
                    raise ValueError(f"no answer field and no \\boxed{{}} in 'solution'; fields present: {sorted(row)}")
                label = boxed[-1].strip()
            else:
                raise
        if not prompt.strip():
            raise ValueError("empty question")
        return {"prompt": prompt, "label": label}
    if task == "sql":
        lab = _get(row, label_field or "label")
        if isinstance(lab, (dict, str)) and (label_field or isinstance(lab, dict)):
            from .sql import parse_sql_label

            db_id, gold = parse_sql_label(lab)
        else:
            _, gold = _need(row, SQL_GOLD_FIELDS, "gold SQL", None)
            _, db_id = _need(row, ("db_id",), "db_id", None)
        _, q = _need(row, SQL_QUESTION_FIELDS, "question", prompt_field)
        return {"prompt": _text_of(q), "label": {"db_id": str(db_id), "sql": str(gold)},
                "db_id": str(db_id), "evidence": str(row.get("evidence") or "")}
    if task == "countdown":
        lab = _get(row, label_field) if label_field else None
        if lab is None:
            lab = {"target": _get(row, "target"), "numbers": _get(row, "numbers") if _get(row, "numbers") is not None
                   else _get(row, "nums")}
            if lab["target"] is None and isinstance(row.get("label"), (dict, str)):
                lab = row["label"]
        from .countdown import _parse_label

        target, numbers = _parse_label(lab)
        if not numbers:
            raise ValueError("countdown row has no numbers")
        return {"prompt": f"Using the numbers {numbers}, create an equation that equals {target}.",
                "label": {"target": target, "numbers": numbers}}
    # any other task (e.g. the demo): explicit or conventional field names, label kept as is,
    # the row's other fields kept too (a task's prompt() may read them)
    pk, p = _need(row, ("prompt", "question", "problem", "input"), "prompt", prompt_field)
    lk, lab = _need(row, ("label", "answer", "target"), "label", label_field)
    if isinstance(lab, str) and "####" in lab:
        lab = _answer_text(lab)  # a GSM8K rationale: its final answer
    if not isinstance(lab, _LABEL_TYPES):
        raise ValueError(f"label field {lk!r} holds a {type(lab).__name__}, expected text, a number, a list or "
                         f"a mapping")
    prompt = _text_of(p)
    if not prompt.strip():
        raise ValueError(f"empty prompt (field {pk!r})")
    extras = {k: v for k, v in row.items() if k not in (pk, lk, "prompt", "label")}
    return {**extras, "prompt": prompt, "label": lab}


def _default_source(path: str) -> str:
    p = path.rstrip("/")
    stem = os.path.basename(p)
    for ext in (".jsonl", ".ndjson", ".json", ".parquet"):
        if stem.lower().endswith(ext):
            stem = stem[: -len(ext)]
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", stem)  # parquet shards: train-00000-of-00001
    if stem.lower() in _GENERIC_STEMS or re.fullmatch(r"(train|test|dev|validation)[-_].*", stem.lower()):
        parent = os.path.basename(os.path.dirname(p))
        if parent.lower() == "data":
            parent = os.path.basename(os.path.dirname(os.path.dirname(p)))
        return parent or stem
    return stem


#: how :func:`load_examples`'s errors name the options that help, by default (its own keywords);
#: each command passes its own spelling (``openrlhf_div.cli.eval.DATA_HINTS``, the local engine's
#: ``openrlhf_div.engines.local.data.DATA_HINTS``); tests/test_hint_options.py parses every one
HINTS: Dict[str, Optional[str]] = {"on_error": "on_error='skip'", "duplicate_ids": "duplicate_ids='rename'",
                                   "max_prompt": "max_prompt_chars"}


def load_examples(path: str, task: str, *, source: Optional[str] = None, prompt_field: Optional[str] = None,
                  label_field: Optional[str] = None, id_field: Optional[str] = None,
                  source_field: Optional[str] = None, split: Optional[str] = None, on_error: str = "raise",
                  limit: Optional[int] = None, strip_instructions: bool = True, duplicate_ids: str = "error",
                  max_prompt_chars: Optional[int] = None,
                  hints: Optional[Mapping[str, Optional[str]]] = None) -> Tuple[List[Dict[str, Any]], LoadSummary]:
    """Load and normalise one dataset file or folder for ``task`` (``math``, ``sql``,
    ``countdown``, or any other name with ``prompt``/``label`` fields).

    ``source`` names the dataset (default: ``data_source`` per row if present, else the file
    name, or its folder for generic names like ``test.jsonl``); ``id`` comes from
    ``id_field`` or a usual id column, else ``"{source}-{row}"``; duplicate ids get ``#k``.
    ``on_error``: ``"raise"`` (default) or ``"skip"`` (counted in the summary and logged).
    ``duplicate_ids``: a repeated ``(source, id)`` is an error naming both lines (``"error"``,
    the default: the trainer caches prompts by id) or, explicitly, renamed ``id#k`` (``"rename"``).
    ``max_prompt_chars``: a longer prompt is a malformed row (the trainer checks tokens later).
    Every example's location (``"file:line"`` / ``"file row i"``) is kept in
    ``summary.locations[id]`` for later errors (prompt too long in tokens, ...).
    ``hints``: how the caller's command spells the options an error points to (:data:`HINTS`;
    the CLIs pass their own: ``--on-error skip`` for ``eval``, ``data.duplicate_ids=rename`` for
    ``train``); ``None`` for one the command lacks, and the message names no option for it.
    """
    hints = {**HINTS, **(hints or {})}
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if duplicate_ids not in ("error", "rename"):
        raise ValueError(f"duplicate_ids must be 'error' or 'rename', got {duplicate_ids!r}")
    summary = LoadSummary(path)
    default_src = source or _default_source(path)
    examples: List[Dict[str, Any]] = []
    seen: Dict[Tuple[str, str], int] = {}
    first_loc: Dict[Tuple[str, str], str] = {}
    for i, (loc, row) in enumerate(read_records(path, split)):
        if limit is not None and len(examples) >= limit:
            break
        try:
            if isinstance(row, Exception):
                raise row
            ex = normalize_record(row, task, prompt_field=prompt_field, label_field=label_field,
                                  strip_instructions=strip_instructions)
            if max_prompt_chars is not None and len(ex["prompt"]) > max_prompt_chars:
                raise ValueError(f"prompt of {len(ex['prompt']):,} characters exceeds the limit of "
                                 f"{max_prompt_chars:,} ("
                                 + (f"raise {hints['max_prompt']} or " if hints.get("max_prompt") else "")
                                 + "drop the row)")
        except (ValueError, TypeError) as exc:
            msg = str(exc) if isinstance(exc, DatasetError) else f"{loc}: {exc}"
            if on_error == "raise":
                skip = hints.get("on_error")
                raise DatasetError(msg + (f" (fix the row, or pass {skip} to skip such rows)" if skip
                                          else " (fix or remove the row)")) from None
            summary.skipped += 1
            if len(summary.errors) < 100:
                summary.errors.append(msg)
            continue
        if source is None and source_field:
            src = str(_get(row, source_field) or default_src)
        elif source is None and isinstance(row.get("data_source"), str) and row["data_source"]:
            src = row["data_source"]
        elif source is None and isinstance(ex.get("source"), str) and ex["source"]:
            src = ex["source"]  # kept from the row (generic tasks)
        else:
            src = default_src
        if id_field:
            rid = _get(row, id_field)
        else:
            _, rid = _first(row, ID_FIELDS)
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
            msg = f"{loc}: id holds a {type(rid).__name__} ({_short(rid)}), expected text or an integer"
            if on_error == "raise":
                raise DatasetError(msg)
            summary.skipped += 1
            summary.errors.append(msg)
            continue
        rid = f"{src}-{i}" if rid is None else str(rid)
        n = seen.get((src, rid), 0)
        seen[(src, rid)] = n + 1
        if n:
            if duplicate_ids == "error":
                raise DatasetError(
                    f"{loc}: duplicate id {rid!r} (source {src!r}), first at {first_loc[(src, rid)]}. Ids must be "
                    f"unique (prompts are cached by id); fix the data"
                    + (f" or rename duplicates explicitly with {hints['duplicate_ids']}"
                       if hints.get("duplicate_ids") else ""))
            rid = f"{rid}#{n}"
            summary.renamed_ids += 1
        else:
            first_loc[(src, rid)] = loc
        ex["source"] = src
        ex["id"] = rid
        summary.locations[rid] = loc
        examples.append(ex)
    summary.loaded = len(examples)
    if summary.skipped:
        logger.warning("%s", summary)
    return examples, summary


# --------------------------------------------------------------------------- prompts
def render_example(task, tokenizer, example: Dict[str, Any], prompt_template: Optional[str] = None,
                   system_prompt: Optional[str] = None, chat_template: bool = True) -> str:
    """The model's prompt text for one normalised example, the same in train, presample and eval.

    Without options this is ``task.render_prompt(example, tokenizer)`` (the task's own template;
    chat messages go through the tokenizer's chat template). ``prompt_template`` replaces the
    task's user message by the template with ``{prompt}`` (the example's question text) filled
    in (other braces are left alone, so LaTeX is safe); ``system_prompt`` replaces the task's
    system message (``""`` removes it). With either option the messages go through the
    tokenizer's chat template when it has one, else they are joined as plain text.
    ``chat_template=False``: the text is ``prompt_template`` (default ``{prompt}``) filled with the
    example's question, as it is -- no chat template, no system message (OpenRLHF's rendering
    without ``--data.apply_chat_template``).
    """
    if not chat_template:
        template = "{prompt}" if prompt_template is None else prompt_template
        if "{prompt}" not in template:
            raise ValueError(f"data.prompt_template must contain {{prompt}} (where the question goes), got {template!r}")
        p = example["prompt"]
        text = p if isinstance(p, str) else "\n\n".join(m["content"] for m in p) + "\n"
        return template.replace("{prompt}", str(text))
    if prompt_template is None and system_prompt is None:
        return task.render_prompt(example, tokenizer)
    from .base import render_prompt

    own = task.prompt(example)
    msgs = [{"role": "user", "content": own}] if isinstance(own, str) else [dict(m) for m in own]
    system = [m for m in msgs if m.get("role") == "system"]
    users = [m for m in msgs if m.get("role") != "system"]
    if prompt_template is not None:
        if "{prompt}" not in prompt_template:
            raise ValueError("data.prompt_template must contain {prompt} (where the question goes), got "
                             f"{prompt_template!r}")
        users = [{"role": "user", "content": prompt_template.replace("{prompt}", str(example["prompt"]))}]
    if system_prompt is not None:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return render_prompt(system + users, tokenizer)
