"""DPH-RL's pre-sampling stage at scale (ALGORITHMS.md section 4): vLLM samples, OpenRLHF's
DeepSpeed forward scores.

For every training prompt, ``n_pre`` responses are sampled from the base policy by vLLM
engines (``--vllm.num_engines`` x ``--vllm.tensor_parallel_size``) at the rollout temperature and
scored by the task's reward-function file inside the vLLM actors (as in training). A prompt
is near-perfect when ``#correct >= tau``; for each, the first correct response is kept and
its per-token base log-probs ``ref_t`` are computed by the **training** forward (OpenRLHF's
``Actor`` as :class:`~.logprob_actor.HiddenLogProbActor`, in a ``ReferenceModelActor`` group,
``--ref.num_nodes`` x ``--ref.num_gpus_per_node``,
temperature-scaled exactly like the trainer's), not taken from the sampler. With
``--div.actor_backend megatron`` (the 32B Megatron configs) that forward is the Megatron
reference actor's, TP-sharded by the ``--megatron.*`` flags (a config's ``presample:`` section
may set e.g. ``megatron.tp: 4`` for its reference GPUs): a bf16 32B model is 16 GB per GPU at
TP 4, where OpenRLHF's DeepSpeed reference at ZeRO-2 holds the full 65 GB on every GPU.

Prompts are rendered with OpenRLHF's own ``PromptDataset`` (same ``--data.*`` flags as
training), processed in chunks of ``--presample.chunk_size``; each finished chunk is written
atomically to ``shards/chunk_NNNNNN.json`` and skipped when the command is rerun, so the stage
can be interrupted and resumed. When all chunks are done, ``d_pef.jsonl``, ``d_exp.jsonl`` and
``summary.json`` are assembled: the layout of the local engine's ``openrlhf-div presample``,
so either engine reads the other's output: the split rule, the record format, the chunk store
and the summary are the engine-neutral :mod:`openrlhf_div.engines.anchor_data`, used by both.
:func:`run` is the Ray/vLLM driver.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from openrlhf_div.engines import overrides as _overrides
from openrlhf_div.engines.anchor_data import (Sample, ShardStore, format_summary, near_perfect,  # noqa: F401
                                              split_chunk)


def response_log_probs(action_log_probs: Sequence[float], prompt_len: int, response_len: int) -> List[float]:
    """The response tokens' log-probs from one row of OpenRLHF's ``Actor`` output.

    For ``sequences = prompt + response`` (length ``T``) the actor returns ``T - 1`` values where
    position ``j`` scores token ``j + 1``: the response is ``[P - 1, P - 1 + R)``.
    """
    out = list(action_log_probs)[prompt_len - 1:prompt_len - 1 + response_len]
    if len(out) != response_len:
        raise ValueError(f"log-prob row of {len(action_log_probs)} values has no {response_len} response "
                         f"positions after a {prompt_len}-token prompt")
    return [float(x) for x in out]


def add_presample_arguments(parser) -> None:
    g = parser.add_argument_group("pre-sampling (--presample.*)")
    g.add_argument("--presample.out", default=None, metavar="DIR",
                   help="output directory (default with --config: the experiment's data.presample_dir, the folder "
                        "training reads as --div.anchor_data)")
    g.add_argument("--presample.n_pre", type=int, default=8, help="samples per prompt (default 8)")
    g.add_argument("--presample.tau", type=int, default=None, help="near-perfect: #correct >= tau (default n_pre)")
    g.add_argument("--presample.drop_unsolved", action="store_true",
                   help="leave prompts with 0 correct out of D_exp (DPH-RL does for math)")
    g.add_argument("--presample.resample_anchor_responses", action="store_true",
                   help="draw each anchor response afresh (n=1, kept if correct), as the DPH-RL authors' code does")
    g.add_argument("--presample.anchor_top_p", type=float, default=None, metavar="P",
                   help="top-p of the fresh anchor draws of --presample.resample_anchor_responses (default: "
                        "--rollout.top_p, the pre-sampling's). The DPH-RL authors pre-sample at 0.95 "
                        "(offline_sampling.sh val_kwargs.top_p) and draw anchors with the rollout's 0.9 "
                        "(generate_sft; ppo_trainer.yaml rollout.top_p)")
    g.add_argument("--presample.chunk_size", type=int, default=256, help="prompts per resumable chunk")
    g.add_argument("--presample.correct_threshold", type=float, default=1.0,
                   help="a sample is correct when its reward >= this")
    g.add_argument("--presample.overwrite", action="store_true", help="discard an existing run in the directory")


def reward_identity(url: str) -> str:
    """What identifies a reward in the settings: a reward file by its name and content (under
    ``ray job submit`` its path lies in Ray's per-upload copy of the working directory, which
    changes with any edit of the repository, so a resubmitted job would find "different settings"),
    anything else (an HTTP endpoint) as given."""
    import hashlib

    if url.endswith(".py") and os.path.isfile(url):
        with open(url, "rb") as fh:
            return f"{os.path.basename(url)} sha256:{hashlib.sha256(fh.read()).hexdigest()[:16]}"
    return url


def settings_from_args(args) -> Dict[str, Any]:
    p = args.presample
    tau = p.tau if p.tau is not None else p.n_pre
    return {"n_pre": p.n_pre, "tau": tau, "drop_unsolved": bool(p.drop_unsolved), "chunk_size": p.chunk_size,
            "correct_threshold": p.correct_threshold, "seed": args.train.seed,
            "temperature": args.rollout.temperature, "top_p": args.rollout.top_p,
            "max_new_tokens": args.rollout.max_new_tokens, "max_len": args.data.max_len,
            "model": args.actor.model_name_or_path, "data": args.data.prompt_dataset,
            "input_key": args.data.input_key, "label_key": args.data.label_key,
            "apply_chat_template": bool(args.data.apply_chat_template), "input_template": args.data.input_template,
            "reward": [reward_identity(u) for u in (args.reward.remote_url or [])],
            # only when on, so runs started before the option existed still resume
            **({"resample_anchor_responses": True} if getattr(p, "resample_anchor_responses", False) else {}),
            **({"anchor_top_p": float(p.anchor_top_p)} if getattr(p, "anchor_top_p", None) is not None else {}),
            # the authors' filter changes which rows the store holds
            **({"drop_long_prompts": True} if getattr(getattr(args, "div", None), "drop_long_prompts", False)
               else {})}


# ------------------------------------------------------------------ Ray / vLLM driver
def _raw_rows(args, strategy) -> List[Dict[str, Any]]:
    from openrlhf.datasets.utils import blending_datasets

    data = blending_datasets(args.data.prompt_dataset, args.data.prompt_probs, strategy, args.train.seed,
                             max_count=args.data.max_samples, dataset_split=args.data.prompt_split)
    data = data.select(range(min(args.data.max_samples, len(data))))
    return [dict(r) for r in data], data


def _sample_chunk(engines, prompts, labels, tokenizer, args, n_pre, top_p: Optional[float] = None) -> List[List[Any]]:
    import ray
    from vllm import SamplingParams

    params = SamplingParams(temperature=args.rollout.temperature, top_p=args.rollout.top_p if top_p is None else top_p,
                            max_tokens=args.rollout.max_new_tokens, min_tokens=1, skip_special_tokens=False)
    refs = [engines[i % len(engines)].generate_responses.remote(
        prompt=p, label=lab, sampling_params=params, max_length=args.data.max_len, hf_tokenizer=tokenizer,
        num_samples=n_pre) for i, (p, lab) in enumerate(zip(prompts, labels))]
    return ray.get(refs)


def _to_samples(responses, tokenizer) -> Tuple[List[int], List[Sample]]:
    """OpenRLHF rollout outputs of one prompt -> (prompt ids, samples)."""
    samples, prompt_ids = [], None
    for r in responses:
        (start, end), = r["action_ranges"]
        ids = r["observation_tokens"]
        prompt_ids = ids[:start]
        resp = ids[start:end]
        samples.append(Sample(resp, tokenizer.decode(resp, skip_special_tokens=True),
                              float(r["reward"]) if r.get("reward") is not None else 0.0))
    return prompt_ids, samples


def _fresh_anchor_samples(engines, prompts, labels, tokenizer, args, parsed, settings) -> List[Optional[Sample]]:
    """One new sample (n=1) for each near-perfect prompt of the chunk; ``None`` for the others."""
    hot = near_perfect([group for _, group in parsed], settings["tau"], settings["correct_threshold"])
    out: List[Optional[Sample]] = [None] * len(parsed)
    if hot:
        draws = _sample_chunk(engines, [prompts[i] for i in hot], [labels[i] for i in hot], tokenizer, args, 1,
                              top_p=settings.get("anchor_top_p"))
        for i, d in zip(hot, draws):
            out[i] = _to_samples(d, tokenizer)[1][0]
    return out


def base_log_prob_batches(pef: List[Dict[str, Any]], pad_id: int, micro: int) -> List[Tuple[list, Any, Any, Any]]:
    """``(rows, sequences, attention_mask, action_mask)`` micro-batches of ``pef`` rows for the
    reference forward (right-padded ``prompt + response``; the mask covers the response)."""
    import torch

    from openrlhf.utils.utils import zero_pad_sequences

    batches = []
    for i in range(0, len(pef), micro):
        part = pef[i:i + micro]
        seqs = [torch.tensor(r["prompt_ids"] + r["response_ids"]) for r in part]
        masks = []
        for r in part:
            m = torch.zeros(len(r["prompt_ids"]) + len(r["response_ids"]), dtype=torch.long)
            m[len(r["prompt_ids"]):] = 1
            masks.append(m[1:])
        batches.append((part, zero_pad_sequences(seqs, "right", value=pad_id, stack=True),
                        zero_pad_sequences([torch.ones_like(s) for s in seqs], "right", stack=True),
                        zero_pad_sequences(masks, "right", stack=True)))
    return batches


def store_base_log_probs(batches: Sequence[Tuple[list, Any, Any, Any]], outs: Sequence[Any]) -> None:
    """Write each row's response log-probs (from the forward's ``[B, T - 1]`` output) into
    ``row["ref_log_probs"]``."""
    for (part, *_), lp in zip(batches, outs):
        for row, r in zip(lp, part):
            r["ref_log_probs"] = response_log_probs(row.tolist(), len(r["prompt_ids"]), len(r["response_ids"]))


def _base_log_probs(group, pef: List[Dict[str, Any]], pad_id: int, micro: int) -> None:
    """Fill ``ref_log_probs`` of the ``pef`` rows with the reference group's forward."""
    import ray

    n_actors = len(group._actor_handlers) // max(1, group.duplicate_actors)
    batches = base_log_prob_batches(pef, pad_id, micro)
    real = len(batches)
    while len(batches) < n_actors:  # OpenRLHF needs at least one batch per actor
        batches.append(batches[0])
    refs = group.async_run_method_batch(method_name="forward", sequences=[b[1] for b in batches],
                                        attention_mask=[b[2] for b in batches],
                                        action_mask=[b[3] for b in batches])
    outs = [x for chunk in ray.get(refs)[::max(1, group.duplicate_actors)] for x in chunk][:real]
    store_base_log_probs(batches[:real], outs)


def reference_actor_class(args):
    """The reference group's actor: the Megatron reference (TP-sharded, ``--megatron.*``; sets
    ``ds.tensor_parallel_size = tp * pp`` for the group's de-duplication) with
    ``--div.actor_backend megatron``, else OpenRLHF's DeepSpeed reference building
    :class:`~.logprob_actor.HiddenLogProbActor`."""
    from openrlhf_div.engines import megatron as mg

    from .logprob_actor import DivReferenceModelActor

    return mg.reference_class_for(args) or DivReferenceModelActor


def run(args) -> Dict[str, Any]:
    """Sample, split, score and write (resumable). ``args`` is the hierarchized namespace."""
    import ray

    from openrlhf_div.progress import progress_bar

    from openrlhf_div.compat.flash_attn_standin import install as install_flash_attn_standin

    install_flash_attn_standin()  # before openrlhf.models (via the launcher); no-op with flash-attn
    from openrlhf.datasets import PromptDataset
    from openrlhf.trainer.ray import create_vllm_engines
    from openrlhf.trainer.ray.launcher import RayActorGroup

    from openrlhf.utils import get_strategy, get_tokenizer

    from .jobs import init_ray

    ref = args.ref.num_nodes * args.ref.num_gpus_per_node
    vllm = args.vllm.num_engines * args.vllm.tensor_parallel_size
    # OpenRLHF's keys + the task's variables, never a key the job already sets; fails fast when
    # the live cluster cannot place the reference actor and the vLLM engines
    init_ray(need={"GPU": ref + vllm, "CPU": ref + vllm, "detail": f"reference {ref} + vllm {vllm}"})
    from .nodes import check_shared_paths, config_paths, watch_nodes

    # the anchors are this stage's output (presample.out), not its input
    check_shared_paths(config_paths(args, skip=("div.anchor_data",)))  # several nodes: each sees every path (nodes.py)
    watch_nodes()  # a node lost mid-run ends the stage in one line (nodes.py)
    strategy = get_strategy(args)
    model = args.actor.model_name_or_path
    tokenizer = get_tokenizer(model, None, "left", strategy, use_fast=not args.data.disable_fast_tokenizer)
    rows, data = _raw_rows(args, strategy)
    dataset = PromptDataset(data, tokenizer, strategy, input_template=args.data.input_template)
    from ..prompt_budget import check_prompt_budget, keep_rows, tokenizer_counter

    div = getattr(args, "div", None)
    budget = check_prompt_budget(dataset.prompts, tokenizer_counter(tokenizer), max_len=args.data.max_len,
                                 max_new_tokens=args.rollout.max_new_tokens,
                                 truncate=bool(getattr(div, "truncate_prompts", False)),
                                 drop=bool(getattr(div, "drop_long_prompts", False)))
    if getattr(div, "drop_long_prompts", False) and budget["over"]:  # the authors' filter: D_pef / D_exp without them
        keep_rows(dataset, budget["keep"])
        rows = [rows[i] for i in budget["keep"]]
    settings = settings_from_args(args)
    store = ShardStore(args.presample.out, settings, len(rows), overwrite=args.presample.overwrite,
                       engine="openrlhf", hint="use another --presample.out or --presample.overwrite")
    todo = store.todo()
    if todo:
        engines = create_vllm_engines(
            args.vllm.num_engines, args.vllm.tensor_parallel_size, model, args.train.seed,
            args.train.full_determinism_enable, args.vllm.enable_prefix_caching, args.vllm.enforce_eager,
            args.data.max_len, None, args.vllm.gpu_memory_utilization, False, None,
            remote_rm_url=args.reward.remote_url)
        ref_cls = reference_actor_class(args)      # before duplicate_actors: may set ds.tensor_parallel_size
        group = RayActorGroup(args.ref.num_nodes, args.ref.num_gpus_per_node, ref_cls,
                              duplicate_actors=args.ds.ring_attn_size * args.ds.tensor_parallel_size)
        ray.get(group.async_init_model_from_pretrained(strategy, model))
        bar = progress_bar(total=len(rows), desc="presample", unit="prompt",
                           initial=len(rows) - sum(store.bounds(c)[1] - store.bounds(c)[0] for c in todo))
        for c in todo:
            lo, hi = store.bounds(c)
            prompts = [dataset.prompts[i] for i in range(lo, hi)]
            labels = [dataset.labels[i] for i in range(lo, hi)]
            outs = _sample_chunk(engines, prompts, labels, tokenizer, args, settings["n_pre"])
            parsed = [_to_samples(o, tokenizer) for o in outs]
            fresh = None
            if settings.get("resample_anchor_responses"):
                fresh = _fresh_anchor_samples(engines, prompts, labels, tokenizer, args, parsed, settings)
            pef, exp, counts = split_chunk(
                rows[lo:hi], prompts, [p for p, _ in parsed], [s for _, s in parsed], n_pre=settings["n_pre"],
                tau=settings["tau"], drop_unsolved=settings["drop_unsolved"],
                correct_threshold=settings["correct_threshold"], fresh=fresh)
            if pef:
                _base_log_probs(group, pef, tokenizer.pad_token_id, args.rollout.micro_batch_size)
            store.write_chunk(c, pef, exp, counts)
            bar.update(hi - lo)
        bar.close()
    return store.assemble()


def presample_argv(cfg: Dict[str, Any]) -> List[str]:
    """A config's ``presample:`` section as flags: plain keys are ``--presample.<key>``; dotted
    keys are OpenRLHF flags that override the training layout for this stage (e.g.
    ``vllm.num_engines: 6``, ``ref.num_gpus_per_node: 2``, ``data.prompt_dataset: full.jsonl``).
    The output folder is the experiment's ``data.presample_dir`` (rendered as ``div.anchor_data``, the
    folder training reads): ``--presample.out`` defaults to it."""
    from openrlhf_div.config import expand_env
    from openrlhf_div.schema import presample_folder

    out: List[str] = []
    folder = presample_folder(cfg, "config")
    if folder is not None and "out" not in (cfg.get("presample") or {}):
        out += ["--presample.out", expand_env(str(folder))]
    for k, v in (cfg.get("presample") or {}).items():
        flag = f"--{k}" if "." in k else f"--presample.{k}"
        if v is True:
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            out += [flag] + [expand_env(str(x)) for x in v]
        elif v not in (None, False):
            out += [flag, expand_env(str(v))]
    return out


def _refuse_second_folder(cfg: Dict[str, Any], rest: Sequence[str]) -> None:
    """A ``--presample.out DIR`` flag beside an experiment whose ``data.presample_dir`` is another folder:
    ValueError (one line). The stage would write where training does not read; the override
    ``data.presample_dir=DIR`` moves both."""
    from openrlhf_div.schema import _same_folder, presample_folder

    folder = presample_folder(cfg, "config") if cfg else None
    if folder is None:
        return
    for i, a in enumerate(rest):
        if a == "--presample.out" and i + 1 < len(rest):
            flag = rest[i + 1]
        elif a.startswith("--presample.out="):
            flag = a.split("=", 1)[1]
        else:
            continue
        if not _same_folder(flag, folder):
            raise ValueError(f"--presample.out {flag}: the experiment's data.presample_dir is {folder} (the folder "
                             f"training reads); pass data.presample_dir={flag} instead (it moves both)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m openrlhf_div.cli.presample_ray``: OpenRLHF flags + ``--presample.*``."""
    import sys

    from openrlhf_div.engines.experiment import load as load_experiment_with

    from .plan import load_argv_plugins
    from .render import _split_config, config_argv, split_overrides
    from .upstream import build_parser, finalize

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        load_argv_plugins(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    parser.prog = "python -m openrlhf_div.cli.presample_ray"
    parser.description = ("DPH-RL pre-sampling at scale: vLLM sampling + DeepSpeed base log-probs into "
                          "D_pef / D_exp (resumable). Takes OpenRLHF's flags for the model, data, rollout and "
                          "vLLM, --div.task for the reward, and --presample.*.")
    add_presample_arguments(parser)
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    try:
        cfg_path, rest = _split_config(argv)
        overrides, rest = split_overrides(rest)  # section.key=value (presample.n_pre=4): the one loader's
        if overrides and not cfg_path:
            raise ValueError(f"{overrides[0]}: a section.key=value override needs --config EXPERIMENT.yaml")
        cfg = load_experiment_with(cfg_path, overrides) if cfg_path else {}
        _refuse_second_folder(cfg, rest)
        user = config_argv(cfg) + presample_argv(cfg) + rest
        parsed = parser.parse_args(user)
        task = getattr(parsed, "div.task", None)
        if task and not getattr(parsed, "reward.remote_url", None):
            from ..flags import reward_func_path

            setattr(parsed, "reward.remote_url", reward_func_path(task))
        if not getattr(parsed, "presample.out", None):
            raise ValueError("no output folder: set data.presample_dir in the experiment (the folder training "
                             "reads) or pass --presample.out DIR")
        if not getattr(parsed, "reward.remote_url", None):
            raise ValueError("no reward: pass --div.task math|sql|countdown or --reward.remote_url FILE.py")
        args = finalize(parsed)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if getattr(parsed, "dry_run", False):
        # the output folder (the experiment's data.presample_dir) and the settings its chunk store keeps
        print(json.dumps({"out": getattr(parsed, "presample.out"), **settings_from_args(args)}, indent=2, default=str))
        return 0
    from .jobs import PlacementError, private_cluster_done
    from .nodes import SharedPathError
    from .render import apply_config_env

    apply_config_env(cfg)
    try:
        print(format_summary(run(args)))
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (issue 43 item 5); the shards written stay
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except BaseException:  # noqa: BLE001
            pass
        out = getattr(parsed, "presample.out", None)
        print(f"stopped (Ctrl-C): pre-sampling into {out}; its finished shards are kept and the same command "
              "resumes from them", file=sys.stderr, flush=True)
        return 130
    except (SharedPathError, PlacementError) as exc:
        private_cluster_done()  # the line says it all: no cluster logs to keep
        print(f"error: {exc}", file=sys.stderr)
        return 2
    private_cluster_done()
    return 0


def driver_flag_names():
    """The Ray drivers' option names without ``--`` (OpenRLHF's, ``div.*``, ``megatron.*`` and this
    driver's ``presample.*``): what an override of an ``openrlhf:`` / ``div:`` / ``presample:`` section
    must name (:mod:`openrlhf_div.engines.overrides`)."""
    from .upstream import build_parser

    parser = build_parser()
    add_presample_arguments(parser)
    ours = ("--config", "--dry-run", "--plugin", "--help")  # launcher options, not settings
    return sorted(s[2:] for s in parser._option_string_actions if s.startswith("--") and s not in ours)


_overrides.register_driver_flags(driver_flag_names)
