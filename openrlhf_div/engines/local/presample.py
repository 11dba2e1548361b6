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

The split rule, the file format, the chunk store and the summary are the engine-neutral
:mod:`openrlhf_div.engines.anchor_data` (the OpenRLHF engine's ``presample_ray`` uses the same);
this module supplies the samples (:func:`~.generation.generate`) and the base log-probs.

Resumable: prompts are processed in chunks of ``chunk_size``; each finished chunk is
written atomically to ``shards/chunk_NNNNNN.json`` and skipped on restart (a chunk file that
is truncated or unreadable is named in a warning and recomputed). Chunk ``c``
samples with a generator seeded from ``(seed, c)`` only, so an interrupted and resumed
run writes byte-identical files to an uninterrupted one. The final files are assembled
from the shards (in order) when every chunk is done.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from openrlhf_div.engines.anchor_data import Sample, ShardStore, format_summary, near_perfect, split_chunk  # noqa: F401

from .config import TrainConfig

from .data import data_fingerprint, example_key, load_task_examples, max_prompt_tokens, prepare_prompts
from .dtype_probe import resolve_auto_dtype
from .generation import pack_sequences, sequence_log_probs


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
                "init_seed": cfg.seed if cfg.model.init_seed is None else cfg.model.init_seed,
                # only when not the default, so runs started before the option existed still resume
                **({"max_positions": cfg.model.tiny_max_positions} if cfg.model.tiny_max_positions != 512 else {})},
            "data": os.path.abspath(train_path), "data_sha256_16": data_sha, "n_examples": n_examples,
            # only when on, so runs started before the option existed still resume
            **({"resample_anchor_responses": True} if p.resample_anchor_responses else {})}


@torch.no_grad()
def _process_chunk(model, tokenizer, task, examples: List[Dict[str, Any]], chunk: int, s: Dict[str, Any],
                   device, prompts: Dict[Any, List[int]], prompt_texts: Dict[Any, str], sampler) -> Dict[str, Any]:
    """Sample (``sampler``: ``rollout.backend``'s, from :mod:`.sampler_registry`), score and split one chunk (the rule: :func:`~openrlhf_div.engines.anchor_data.split_chunk`),
    then add the kept responses' base log-probs from the training forward."""
    n_pre = s["n_pre"]
    prompt_ids = [prompts[example_key(ex)] for ex in examples]
    texts = [prompt_texts[example_key(ex)] for ex in examples]
    gen = torch.Generator(device=device).manual_seed(chunk_seed(s["seed"], chunk))
    out = sampler.generate(prompt_ids, n_samples=n_pre, max_new_tokens=s["max_new_tokens"],
                           temperature=s["temperature"], top_p=s["top_p"], generator=gen)
    samples = []
    for i, ex in enumerate(examples):
        rows = range(i * n_pre, (i + 1) * n_pre)
        res = task.reward_results([out.texts[j] for j in rows], [ex.get("label")] * len(rows))
        samples.append([Sample(out.response_ids[j], out.texts[j], correct=bool(r.correct))
                        for j, r in zip(rows, res)])
    fresh = None
    if s.get("resample_anchor_responses"):
        fresh = _resample_anchors(model, tokenizer, task, examples, prompt_ids,
                                  near_perfect(samples, s["tau"]), chunk, s, device, sampler)
    pef, exp, n_correct = split_chunk(examples, texts, prompt_ids, samples, n_pre=n_pre, tau=s["tau"],
                                      drop_unsolved=s["drop_unsolved"], fresh=fresh)
    if pef:
        ids, attn, rmask = pack_sequences([r["prompt_ids"] for r in pef], [r["response_ids"] for r in pef],
                                          tokenizer.pad_token_id, device)
        ref = sequence_log_probs(model, ids, attn, rmask, temperature=s["temperature"]).float().cpu()
        for k, r in enumerate(pef):
            r["ref_log_probs"] = [float(x) for x in ref[k, :len(r["response_ids"])].tolist()]
    return {"pef": pef, "exp": exp, "n_correct": n_correct}


def _resample_anchors(model, tokenizer, task, examples, prompt_ids, hot: List[int], chunk: int, s: Dict[str, Any],
                      device, sampler) -> List[Optional[Sample]]:
    """One fresh sample (seeded from ``(seed, chunk, 1)``) for each near-perfect prompt ``hot``;
    ``None`` for the others."""
    fresh: List[Optional[Sample]] = [None] * len(examples)
    if not hot:
        return fresh
    gen = torch.Generator(device=device).manual_seed(chunk_seed(s["seed"], chunk, stream=1))
    out = sampler.generate([prompt_ids[i] for i in hot], n_samples=1, max_new_tokens=s["max_new_tokens"],
                           temperature=s["temperature"], top_p=s["top_p"], generator=gen)
    ok = task.reward_results(out.texts, [examples[i].get("label") for i in hot])
    for k, (i, res) in enumerate(zip(hot, ok)):
        fresh[i] = Sample(out.response_ids[k], out.texts[k], correct=bool(res.correct))
    return fresh


def output_folder(cfg: TrainConfig, output_dir: Optional[str] = None) -> str:
    """Where the local pre-sampling writes: ``output_dir`` (``--out``), else ``presample.output_dir`` (the
    write side's own override), else ``data.presample_dir`` (the folder training reads), else
    ``OUTPUT_DIR/presample``."""
    return os.path.abspath(output_dir or cfg.presample.output_dir or cfg.data.presample_dir
                           or os.path.join(cfg.output_dir, "presample"))


def presample(cfg: TrainConfig, output_dir: Optional[str] = None, *, overwrite: bool = False,
              max_new_chunks: Optional[int] = None, progress: bool = True,
              hint: str = "use another output directory or --overwrite") -> Dict[str, Any]:
    """Run (or resume) the pre-sampling stage; returns the summary (``{"complete": False,
    ...}`` when ``max_new_chunks`` stopped it early; run again to continue). ``hint``: the caller's
    way out of a folder written with other settings (``openrlhf-div run`` has no ``--overwrite``)."""
    from openrlhf_div.progress import progress_bar
    from openrlhf_div.tasks import get_task

    from .models import build_policy, resolve_device

    from .realmodel import resolve_num_threads

    torch.set_num_threads(resolve_num_threads(cfg.num_threads))
    out_dir = output_folder(cfg, output_dir)
    if cfg.data.train is None:
        raise ValueError("presample needs data.train (the JSONL of training examples to split)")
    examples, data_summary = load_task_examples(cfg, cfg.data.train, split=cfg.data.split)
    s = _settings(cfg, cfg.data.train, len(examples))
    s.update({k: getattr(cfg.data, k) for k in ("split", "prompt_field", "label_field", "id_field",
                                                 "prompt_template", "system_prompt") if getattr(cfg.data, k)})
    if not cfg.data.chat_template:  # only when off, so runs started before the option existed still resume
        s["chat_template"] = False
    if not 1 <= s["tau"] <= s["n_pre"]:
        raise ValueError(f"presample.tau must be in [1, n_pre={s['n_pre']}], got {s['tau']}")
    from .sampler_registry import build_sampler, resolve_backend

    device = resolve_device(cfg.device)
    model, tokenizer = build_policy(cfg, device, dtype=torch.float32 if cfg.model.dtype == "auto" else None)
    if resolve_auto_dtype(cfg, model, device) is not None:  # model.dtype auto: the probe's choice (.dtype_probe)
        from .models import DTYPES

        model.to(DTYPES[cfg.model.dtype])
    model.eval()
    backend = resolve_backend(cfg.rollout.backend, model, device)
    if backend != "hf":  # recorded only when not hf, so runs started before the option existed still resume
        s["sampler"] = backend
    store = ShardStore(out_dir, s, len(examples), overwrite=overwrite, engine="local",
                       hint=hint)
    task = get_task(cfg.task, **(cfg.task_options or {}))
    prompt_texts: Dict[Any, str] = {}
    prompts = prepare_prompts(task, tokenizer, examples, data_summary, cfg.data,
                              max_prompt_tokens(cfg, model, s["max_new_tokens"]), texts_out=prompt_texts)
    todo = store.todo()
    n_done = store.n_chunks - len(todo)
    initial = len(examples) - sum(store.bounds(c)[1] - store.bounds(c)[0] for c in todo)
    if max_new_chunks is not None:
        todo = todo[:max(0, int(max_new_chunks))]
    t0 = time.time()
    bar = progress_bar(total=len(examples), initial=initial, desc="presample", unit="prompt",
                       disable=not progress, dynamic_ncols=True)
    sampler = None
    if todo:  # no fallback: the settings above name the sampler, so another one must not run under them
        try:
            sampler = build_sampler(backend, model, tokenizer, cfg.rollout, device=device, seed=cfg.seed)
        except Exception as exc:
            if cfg.rollout.backend != "auto":
                raise
            raise RuntimeError(f"presample: rollout.backend=auto chose {backend} but it did not start "
                               f"({type(exc).__name__}: {str(exc)[:300]}); run again with rollout.backend=hf") from exc
    try:
        for c in todo:
            lo, hi = store.bounds(c)
            res = _process_chunk(model, tokenizer, task, examples[lo:hi], c, s, device, prompts, prompt_texts,
                                 sampler)
            store.write_chunk(c, res["pef"], res["exp"], res["n_correct"])
            n_done += 1
            bar.update(hi - lo)
    finally:
        if todo:
            sampler.close()
    bar.close()
    if n_done < store.n_chunks:
        return {"complete": False, "chunks_done": n_done, "chunks_total": store.n_chunks, "output_dir": out_dir}
    summary = store.assemble()
    summary["seconds"] = time.time() - t0
    return summary
