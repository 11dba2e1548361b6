"""DPH-RL's pre-sampling stage (ALGORITHMS.md section 4), run once before training.

For every training prompt, sample ``n_pre`` responses from the **base** policy at the
rollout temperature and score them with the task. A prompt is *near-perfect* when
``#correct >= tau`` (default ``tau = n_pre``).

* ``d_pef.jsonl``: per near-perfect prompt, ONE correct response (the first correct
  sample) with its per-token base log-probs ``ref_t`` computed by the training forward
  (:func:`~.generation.sequence_log_probs` at the rollout temperature, not the sampler's
  numbers), plus the example (prompt, label, source, id), the prompt/response token ids
  and ``n_correct``.
* ``d_exp.jsonl``: the other examples, each with ``n_correct`` / ``n_pre`` added; with
  ``drop_unsolved`` the prompts with 0 correct are left out.
* ``resample_anchor_responses`` (the authors' code, seamoke/DPH-RL ``generate_sft``): the anchor
  response of a near-perfect prompt is one *fresh* sample (its own seeded draw), kept only if
  correct -- a near-perfect prompt whose fresh sample fails has no anchor (and is not in
  ``D_exp`` either, as in the authors' split).
* ``summary.json``: the split's counts, the ``#correct`` histogram and the settings.

Resumable: prompts are processed in chunks of ``chunk_size``; each finished chunk is
written atomically to ``shards/chunk_NNNNNN.json`` and skipped on restart (a chunk file that
is truncated or unreadable is named in a warning and recomputed). Chunk ``c``
samples with a generator seeded from ``(seed, c)`` only, so an interrupted and resumed
run writes byte-identical files to an uninterrupted one. The final files are assembled
from the shards (in order) when every chunk is done.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from .config import TrainConfig
from openrlhf_div.io import atomic_write_json, atomic_write_jsonl

from .data import data_fingerprint, example_key, load_task_examples, max_prompt_tokens, prepare_prompts
from .generation import generate, pack_sequences, sequence_log_probs


def chunk_seed(seed: int, chunk: int, stream: int = 0) -> int:
    """The sampling seed of chunk ``chunk``: a function of ``(seed, chunk)`` only (``stream`` 1:
    the fresh anchor draws of ``resample_anchor_responses``)."""
    key = [int(seed), int(chunk)] + ([int(stream)] if stream else [])
    return int(np.random.SeedSequence(key).generate_state(1, dtype=np.uint64)[0] % (2**63))


def _settings(cfg: TrainConfig, train_path: str, n_examples: int) -> Dict[str, Any]:
    p, r = cfg.presample, cfg.rollout
    data_sha = data_fingerprint(train_path)
    return {"n_pre": p.n_pre, "tau": p.tau if p.tau is not None else p.n_pre, "drop_unsolved": bool(p.drop_unsolved),
            "chunk_size": p.chunk_size, "seed": cfg.seed, "temperature": r.temperature, "top_p": r.top_p,
            "max_new_tokens": p.max_new_tokens or r.max_new_tokens, "task": cfg.task,
            "task_options": cfg.task_options, "model": cfg.model.path or {
                "tiny_vocab": cfg.model.tiny_vocab, "hidden": cfg.model.tiny_hidden_size,
                "layers": cfg.model.tiny_layers, "heads": cfg.model.tiny_heads, "kv_heads": cfg.model.tiny_kv_heads,
                "init_seed": cfg.seed if cfg.model.init_seed is None else cfg.model.init_seed},
            "data": os.path.abspath(train_path), "data_sha256_16": data_sha, "n_examples": n_examples,
            # only when on, so runs started before the option existed still resume
            **({"resample_anchor_responses": True} if p.resample_anchor_responses else {})}


_CHUNK_KEYS = ("chunk", "pef", "exp", "n_correct")


def _read_chunk(path: str) -> Optional[Dict[str, Any]]:
    """A finished chunk's contents, or None when it is absent. A chunk that is truncated or
    unreadable (a kill or a full disk; chunks are written atomically, so only outside damage
    does this) is named, deleted and recomputed."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        if not isinstance(res, dict) or any(k not in res for k in _CHUNK_KEYS):
            raise ValueError(f"missing keys (expected {', '.join(_CHUNK_KEYS)})")
        return res
    except (OSError, ValueError) as exc:
        print(f"[openrlhf-div] warning: pre-sampling chunk {path} is truncated or unreadable "
              f"({type(exc).__name__}: {exc}); recomputing it")
        os.remove(path)
        return None


@torch.no_grad()
def _process_chunk(model, tokenizer, task, examples: List[Dict[str, Any]], chunk: int, s: Dict[str, Any],
                   device, prompts: Dict[Any, List[int]], prompt_texts: Dict[Any, str]) -> Dict[str, Any]:
    n_pre, tau = s["n_pre"], s["tau"]
    prompt_ids = [prompts[example_key(ex)] for ex in examples]
    texts = [prompt_texts[example_key(ex)] for ex in examples]
    gen = torch.Generator(device=device).manual_seed(chunk_seed(s["seed"], chunk))
    out = generate(model, tokenizer, prompt_ids, n_samples=n_pre, max_new_tokens=s["max_new_tokens"],
                   temperature=s["temperature"], top_p=s["top_p"], generator=gen)
    pef, exp, n_correct_all = [], [], []
    chosen = []  # (example index, sample row) of each near-perfect prompt's kept response
    for i, ex in enumerate(examples):
        rows = range(i * n_pre, (i + 1) * n_pre)
        correct = [bool(r.correct) for r in task.reward_results([out.texts[j] for j in rows],
                                                                 [ex.get("label")] * len(rows))]
        c = int(sum(correct))
        n_correct_all.append(c)
        if c >= tau and c > 0:
            chosen.append((i, i * n_pre + correct.index(True), c))
        elif not (s["drop_unsolved"] and c == 0):
            exp.append({**ex, "n_correct": c, "n_pre": n_pre})
    texts_of = out.texts
    extra: Dict[str, Any] = {}
    if chosen and s.get("resample_anchor_responses"):
        n_near_perfect = len(chosen)
        chosen, fresh_texts, fresh_ids = _resample_anchors(model, tokenizer, task, examples, prompt_ids, chosen,
                                                           chunk, s, device)
        texts_of = dict(zip((j for _, j, _ in chosen), fresh_texts))
        r_ids = fresh_ids
        extra["n_resample_failed"] = n_near_perfect - len(chosen)
    else:
        r_ids = [out.response_ids[j] for _, j, _ in chosen]
    if chosen:
        p_ids = [prompt_ids[i] for i, _, _ in chosen]
        ids, attn, rmask = pack_sequences(p_ids, r_ids, tokenizer.pad_token_id, device)
        ref = sequence_log_probs(model, ids, attn, rmask, temperature=s["temperature"]).float().cpu()
        for k, (i, j, c) in enumerate(chosen):
            n = len(r_ids[k])
            pef.append({**examples[i], "prompt_text": texts[i], "response": texts_of[j],
                        "prompt_ids": p_ids[k], "response_ids": r_ids[k],
                        "ref_log_probs": [float(x) for x in ref[k, :n].tolist()],
                        "n_correct": c, "n_pre": n_pre})
    return {"chunk": chunk, "pef": pef, "exp": exp, "n_correct": n_correct_all, **extra}


def _resample_anchors(model, tokenizer, task, examples, prompt_ids, chosen, chunk: int, s: Dict[str, Any], device):
    """One fresh sample per near-perfect prompt (seeded from ``(seed, chunk, 1)``), kept if correct.
    Returns the kept ``chosen`` entries (``j`` re-indexed to the fresh draw), texts and ids."""
    gen = torch.Generator(device=device).manual_seed(chunk_seed(s["seed"], chunk, stream=1))
    fresh = generate(model, tokenizer, [prompt_ids[i] for i, _, _ in chosen], n_samples=1,
                     max_new_tokens=s["max_new_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                     generator=gen)
    ok = task.reward_results(fresh.texts, [examples[i].get("label") for i, _, _ in chosen])
    kept, texts, ids = [], [], []
    for k, ((i, _, c), res) in enumerate(zip(chosen, ok)):
        if bool(res.correct):
            kept.append((i, k, c))
            texts.append(fresh.texts[k])
            ids.append(fresh.response_ids[k])
    return kept, texts, ids


def presample(cfg: TrainConfig, output_dir: Optional[str] = None, *, overwrite: bool = False,
              max_new_chunks: Optional[int] = None, progress: bool = True) -> Dict[str, Any]:
    """Run (or resume) the pre-sampling stage; returns the summary (``{"complete": False,
    ...}`` when ``max_new_chunks`` stopped it early; run again to continue)."""
    from openrlhf_div.progress import progress_bar
    from openrlhf_div.tasks import get_task

    from .trainer import build_policy, resolve_device

    from .realmodel import resolve_num_threads

    torch.set_num_threads(resolve_num_threads(cfg.num_threads))
    out_dir = os.path.abspath(output_dir or cfg.presample.output_dir or os.path.join(cfg.output_dir, "presample"))
    if cfg.data.train is None:
        raise ValueError("presample needs data.train (the JSONL of training examples to split)")
    examples, data_summary = load_task_examples(cfg, cfg.data.train, split=cfg.data.split)
    s = _settings(cfg, cfg.data.train, len(examples))
    s.update({k: getattr(cfg.data, k) for k in ("split", "prompt_field", "label_field", "id_field",
                                                 "prompt_template", "system_prompt") if getattr(cfg.data, k)})
    if not 1 <= s["tau"] <= s["n_pre"]:
        raise ValueError(f"presample.tau must be in [1, n_pre={s['n_pre']}], got {s['tau']}")
    shard_dir = os.path.join(out_dir, "shards")
    if overwrite and os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(shard_dir, exist_ok=True)
    settings_path = os.path.join(shard_dir, "settings.json")
    if os.path.exists(settings_path):
        with open(settings_path) as f:
            old = json.load(f)
        if old != json.loads(json.dumps(s)):
            diff = sorted(k for k in set(old) | set(s) if old.get(k) != json.loads(json.dumps(s)).get(k))
            raise ValueError(f"{out_dir} holds a pre-sampling run with different settings ({', '.join(diff)}); "
                             "use another output directory or --overwrite")
    else:
        atomic_write_json(settings_path, s, ensure_ascii=False, indent=1)

    device = resolve_device(cfg.device)
    task = get_task(cfg.task, **(cfg.task_options or {}))
    model, tokenizer = build_policy(cfg, device)
    model.eval()
    prompt_texts: Dict[Any, str] = {}
    prompts = prepare_prompts(task, tokenizer, examples, data_summary, cfg.data,
                              max_prompt_tokens(cfg, model, s["max_new_tokens"]), texts_out=prompt_texts)
    C = s["chunk_size"]
    n_chunks = (len(examples) + C - 1) // C
    loaded: Dict[int, Dict[str, Any]] = {}
    for c in range(n_chunks):
        res = _read_chunk(os.path.join(shard_dir, f"chunk_{c:06d}.json"))
        if res is not None:
            loaded[c] = res
    done = set(loaded)
    todo = [c for c in range(n_chunks) if c not in done]
    if max_new_chunks is not None:
        todo = todo[:max(0, int(max_new_chunks))]
    t0 = time.time()
    bar = progress_bar(total=len(examples), initial=min(len(done) * C, len(examples)), desc="presample",
                       unit="prompt", disable=not progress, dynamic_ncols=True)
    for c in todo:
        part = examples[c * C:(c + 1) * C]
        res = _process_chunk(model, tokenizer, task, part, c, s, device, prompts, prompt_texts)
        atomic_write_json(os.path.join(shard_dir, f"chunk_{c:06d}.json"), res, ensure_ascii=False, indent=1)
        loaded[c] = json.loads(json.dumps(res))  # what a later reader of the file would see
        done.add(c)
        bar.update(len(part))
    bar.close()
    if len(done) < n_chunks:
        return {"complete": False, "chunks_done": len(done), "chunks_total": n_chunks, "output_dir": out_dir}

    pef, exp, hist = [], [], [0] * (s["n_pre"] + 1)
    n_resample_failed = 0
    for c in range(n_chunks):
        res = loaded[c]
        n_resample_failed += int(res.get("n_resample_failed", 0))
        pef += res["pef"]
        exp += res["exp"]
        for k in res["n_correct"]:
            hist[k] += 1
    atomic_write_jsonl(os.path.join(out_dir, "d_pef.jsonl"), pef)
    atomic_write_jsonl(os.path.join(out_dir, "d_exp.jsonl"), exp)
    summary = {"complete": True, "n_prompts": len(examples), "n_pef": len(pef), "n_exp": len(exp),
               "n_dropped_unsolved": hist[0] if s["drop_unsolved"] else 0,
               **({"n_resample_failed": n_resample_failed} if s.get("resample_anchor_responses") else {}),
               "correct_histogram": hist, "mean_correct_rate": float(
                   sum(k * v for k, v in enumerate(hist)) / max(1, s["n_pre"] * len(examples))),
               **{k: v for k, v in s.items() if k not in ("n_examples",)}, "output_dir": out_dir}
    atomic_write_json(os.path.join(out_dir, "summary.json"), summary, ensure_ascii=False, indent=1)
    summary["seconds"] = time.time() - t0
    return summary


def format_summary(s: Dict[str, Any]) -> str:
    if not s.get("complete"):
        return (f"pre-sampling paused: {s['chunks_done']}/{s['chunks_total']} chunks done in {s['output_dir']} "
                "(run the same command again to continue)")
    n = max(1, s["n_prompts"])
    lines = [
        f"pre-sampling done: {s['n_prompts']} prompts x {s['n_pre']} samples (T={s['temperature']}), "
        f"near-perfect = #correct >= {s['tau']}",
        f"  D_pef (anchor): {s['n_pef']:6d} prompts ({100 * s['n_pef'] / n:.1f}%)",
        f"  D_exp (online): {s['n_exp']:6d} prompts ({100 * s['n_exp'] / n:.1f}%)"
        + (f", {s['n_dropped_unsolved']} unsolved dropped" if s["drop_unsolved"] else ""),
        "  #correct histogram: " + " ".join(f"{k}:{v}" for k, v in enumerate(s["correct_histogram"])),
        f"  files: {s['output_dir']}/d_pef.jsonl, d_exp.jsonl, summary.json",
    ]
    if s.get("resample_anchor_responses"):
        lines.insert(2, f"  anchor responses drawn afresh (n=1, kept if correct): {s['n_resample_failed']} "
                        "near-perfect prompt(s) lost their anchor")
    return "\n".join(lines)
