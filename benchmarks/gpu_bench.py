"""The GPU benchmark: the figures a user decides by, from one command on one GPU
(``bash benchmarks/gpu_bench.sh --results DIR``).

Every case runs in its own process (a crash, an out-of-memory error or a time-out costs that case
only) on a model built from a config with the real shapes and random weights. **Nothing measured is
lost:** a case rewrites its JSON (atomically) after every row it measures, so a case killed at its
time limit keeps its first rows; the driver marks the rows it did not reach ``not_reached`` with the
reason, and rewrites ``DIR/gpu_bench.json`` and ``DIR/gpu_bench.md`` after every case. ``DIR`` is all
that needs to come back: those two files and the full log ``gpu_bench.log`` (at most 8 files).

Cases, in the default order (the ones only a GPU can prove first; ``--cases`` sets another order):

``gemm``
    A bf16 ``[n, n] @ [n, n]`` matmul on this device (CUDA events / synchronised timers after
    warm-up): the measured peak the other cases' ``mfu_gemm`` is taken against.
``actor_step``
    OpenRLHF's DeepSpeed ZeRO-2 actor step (``DeepspeedStrategy`` with its real CUDA set-up, FusedAdam
    JIT-built, and torch's Adam as the fallback when that build fails; our ``DivActorPPOTrainer`` and
    ``HiddenLogProbActor``), grpo and dph_js (anchor rows), synthetic rollouts of 1,024 tokens (256
    prompt), 16 sequences per optimizer step: step time after a warm-up step (the warm-up includes
    the JIT build; its time is reported apart), tokens/s, MFU, peak memory. No Ray, no vLLM (Ray:
    ``benchmarks/ray_import_stub.py``; vLLM: ``openrlhf_div.compat``'s import stub).
``megatron``
    ``MegatronEngine`` at TP=1 (megatron-core's local layer spec: no Transformer Engine on the
    target): the log-prob noise floor (the HF model in bf16 vs the same weights in float32, same
    tokens), log-probs vs the HF model (bf16; tolerance 2 x that floor), optimizer-step time,
    tokens/s, MFU, measured peak memory vs ``openrlhf-div plan-memory``'s plan of the same layout
    (with the attention the engine runs), offload / reload bit-exact, then the planner against the
    card at three more layouts (recompute none / full x micro-batch 1 / the plan's).
``logprobs``
    ``log_probs_from_hidden`` vs full ``[tokens, V]`` logits + ``log_softmax`` at V = 151,936,
    H = 1,536, bf16 inputs (TF32 on for the fp32 matmuls that remain), with entropy, training
    (forward + backward) and no-grad: time and peak memory above the inputs, after a warm-up call
    (allocations made there are reused: the cache is not emptied between repeats).
``decode``
    The local engine's lean decoder (``openrlhf_div.engines.local.generation.generate``), Qwen2.5-1.5B
    shape, bf16, 64 rows (8 prompts x 8 samples) of 128 prompt tokens and 128 new tokens, per
    ``decode_step``: ``dynamic`` (today's step), ``static`` (fixed shapes, no host synchronisation) and
    ``graph`` (that step replayed as a CUDA graph; not in the CPU dry run): ms per bare decode step (the
    decoder's ``step`` alone, greedy tokens), and ``generate`` end to end (tokens/s), after a warm-up
    call; each variant's samples against the dynamic step's (same seed) and the graph's against the
    static step's (bit for bit expected: the same kernels).
``methods``
    The local engine (``openrlhf_div.engines.local.Trainer``), Qwen2.5-1.5B shape (vocab 151,936,
    hidden 1,536, 28 layers), bf16 with float32 master weights and AdamW moments, RL steps per
    method (grpo, rkl, dph_js, dph_f, ds_grpo, lad_js, clip_cov) after a warm-up step: step time and
    its ratio to GRPO's, per phase (generation, old / reference log-probs, forward + backward,
    optimizer incl. the master-weight copies, gradient clipping and the weight check; "other" =
    rewards and packing; timed through the trainer's ``phase_hooks``), generation tokens/s, the
    actor's MFU and peak memory. Rewards: a hash of the response text (half the responses
    "correct"), so groups are mixed as in real training; DPH's D_pef: synthetic anchor rows of the
    same lengths (a random model has no correct samples to pre-sample).
``largest``
    The largest of the 7B / 3B / 1.5B / 0.5B shapes that trains a local-engine GRPO step (bf16 + master
    weights) on this GPU after a warm-up step, largest first, stopping at the first that fits; a shape
    out of memory is tried once more with gradient checkpointing (the row says whether it was on).

Every timed figure is given as n, min, median and max over the measured repeats (after warm-up,
the device synchronised before each clock read); peak memory is reset before and read after
each row. MFU two ways: ``mfu`` counts FLOPs the way verl's ``FlopsCounter`` does (``6 N`` per
trained token, ``N`` = the dense parameters with embedding *and* LM head counted, ``2 V h``;
prompt and response tokens; plus ``12 * sum(seqlen^2) * head_dim * heads * layers`` for
attention) over the training time (forward + backward + optimizer; generation and log-prob passes
excluded), divided by the datasheet's dense bf16 peak (H100 / H200 SXM: 989 TFLOP/s;
``--peak-tflops`` for another card); ``mfu_gemm`` divides the same by the bf16 GEMM peak the
``gemm`` case measured on this device in this run.

``--dry-run`` runs every case at toy size on the CPU (the rehearsal: the same code paths, no
figures worth reading; a nominal datasheet peak of 1 TFLOP/s); ``gpu_bench.sh --dry-run`` loads
the CPU seams the end-to-end tests use for OpenRLHF's and megatron-core's CUDA-only calls
(docs/scaling.md, "CUDA-only seams") into its processes; this file imports nothing from tests/.
``--report DIR [DIR...]`` merges results folders and writes the docs section.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN = "<!-- BEGIN gpu-bench: generated by benchmarks/gpu_bench.py -->"
END = "<!-- END gpu-bench -->"
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}   # dense bf16, SXM (datasheet)
QWEN25 = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
              tie_word_embeddings=True)
SHAPES: Dict[str, Dict[str, Any]] = {
    "qwen2.5-0.5b": dict(QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
    "qwen2.5-3b": dict(QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2),
    "qwen2.5-7b": dict(QWEN25, vocab_size=152064, tie_word_embeddings=False, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
    # dry-run shapes (CPU)
    "toy": dict(vocab_size=512, max_position_embeddings=512, rope_theta=1e4, rms_norm_eps=1e-6,
                tie_word_embeddings=True, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2),
    "toy-l": dict(vocab_size=512, max_position_embeddings=512, rope_theta=1e4, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2),
}
METHODS = ("grpo", "rkl", "dph_js", "dph_f", "ds_grpo", "lad_js", "clip_cov")
#: the default order: the measured GEMM peak first (seconds), then what only a GPU can prove
#: (DeepSpeed's FusedAdam JIT build and its fallback, Megatron on CUDA, the log-prob kernels), then
#: the local engine's methods, then the largest model
CASES = ("gemm", "actor_step", "megatron", "logprobs", "decode", "methods", "largest")
#: cases sharing one process in a dry run (saves interpreter start-ups on the CPU); on a GPU each case
#: has its own process, so that a crash or an out-of-memory error costs that case only
DRY_RUN_GROUPS = (("gemm", "logprobs", "decode", "methods", "largest"), ("actor_step",), ("megatron",))
#: guessed seconds per case on an H100, set-up included, used until a GPU run has measured them
#: (``--report`` writes the measured ones to MEASURED); the default cases' sum keeps SLACK under
#: the default budget (when decode came in, actor_step's guess went from 150 to 110 s and logprobs' from 45 to
#: 25 s: the H200 run measured them at 69 and 9 s, benchmarks/gpu_bench_measured.json; decode's 60 s: a 1.5B
#: model built on the device, then ~14 dynamic-step passes of 128 tokens at the measured 25 ms a step, fewer
#: seconds for static and graph)
GUESS_S = {"gemm": 15, "actor_step": 110, "megatron": 75, "logprobs": 25, "decode": 60, "methods": 140,
           "largest": 60}
MEASURED = os.path.join(ROOT, "benchmarks", "gpu_bench_measured.json")
SLACK = 0.10
DEFAULT_BUDGET_S = 540.0
#: the log-prob noise floor: the HF model in bf16 vs the same weights in float32, same tokens, at the
#: real shape (Qwen2.5-1.5B config, the bench's random weights and its Megatron log-prob batch: 2 x 512
#: tokens, prompt 256, 512 response tokens), measured on a CPU (benchmarks/gpu_bench_noise_floor.py,
#: torch 2.13 CPU, 2026-11-28; docs/benchmarks.md, "Log-prob noise floor")
LOGPROB_FLOOR_CPU = {"max_abs": 0.0746, "mean_abs": 0.0200, "tokens": 512}
#: two bf16 implementations each within the floor of the float32 answer differ by at most twice it
#: (triangle inequality): the tolerance of a bf16-vs-bf16 log-prob comparison is twice the floor, the
#: floor measured in the same run when there is one (the megatron case's logprob_floor row), else the CPU's
LOGPROB_TOL_FACTOR = 2.0
LOGPROB_TOL_BF16 = round(LOGPROB_TOL_FACTOR * LOGPROB_FLOOR_CPU["max_abs"], 3)
LOGPROB_TOL_SOURCE = "2 x the bf16-vs-float32 noise floor measured on a CPU (max 0.0746)"
FAULT_ENV = "GPU_BENCH_FAULT"   # "<case>:<rows>": the case's process kills itself after that many rows (tests)


def estimates(path: str = MEASURED) -> Dict[str, Dict[str, Any]]:
    """Seconds per case: the wall time a GPU run measured (``--report`` records it), else the guess."""
    out = {n: {"s": float(v), "source": "guess (not measured)"} for n, v in GUESS_S.items()}
    try:
        with open(path) as fh:
            got = json.load(fh)
    except (OSError, ValueError):
        return out
    for n, rec in got.get("cases", {}).items():
        if n in out and rec.get("wall_s"):
            out[n] = {"s": float(rec["wall_s"]), "source": f"measured on {got.get('device')} ({got.get('date')})"}
    return out


def plan(dry_run: bool) -> Dict[str, Dict[str, Any]]:
    """Each case's parameters: the GPU sizes, or toy sizes for ``--dry-run`` (pure; tests read it)."""
    if dry_run:
        return {
            "gemm": dict(n=128, warmup=2, repeats=3, inner=2),
            "methods": dict(shape="toy", methods=list(METHODS), prompts=2, group=4, prompt_len=8, new_tokens=8,
                            micro=4, warmup=1, steps=2),
            "logprobs": dict(vocab=2048, hidden=64, tokens=[64, 256], repeats=2),
            "decode": dict(shape="toy", prompts=4, group=4, prompt_len=8, new_tokens=8, warmup=1, repeats=2,
                           steps=["dynamic", "static"]),   # a CUDA graph needs CUDA
            "actor_step": dict(shape="toy", methods=["grpo", "dph_js"], micro=2, batch=8, seq=64, prompt=16,
                               warmup=1, steps=2, zero_stage=2),
            "megatron": dict(shape="toy", micro=2, n_micro=2, seq=64, prompt=16, lp_rows=2, lp_seq=32, warmup=1,
                             steps=2),
            "largest": dict(shapes=["toy-l", "toy"], prompts=2, group=4, prompt_len=8, new_tokens=8, micro=2,
                            warmup=1, steps=1),
        }
    return {
        "gemm": dict(n=8192, warmup=5, repeats=10, inner=10),
        "methods": dict(shape="qwen2.5-1.5b", methods=list(METHODS), prompts=8, group=8, prompt_len=128,
                        new_tokens=128, micro=32, warmup=1, steps=3),
        "logprobs": dict(vocab=151936, hidden=1536, tokens=[4096, 16384], repeats=5),
        "decode": dict(shape="qwen2.5-1.5b", prompts=8, group=8, prompt_len=128, new_tokens=128, warmup=1,
                       repeats=3, steps=["dynamic", "static", "graph"]),
        "actor_step": dict(shape="qwen2.5-1.5b", methods=["grpo", "dph_js"], micro=4, batch=16, seq=1024,
                           prompt=256, warmup=1, steps=5, zero_stage=2),
        "megatron": dict(shape="qwen2.5-1.5b", micro=4, n_micro=4, seq=1024, prompt=256, lp_rows=2, lp_seq=512,
                         warmup=1, steps=5),
        "largest": dict(shapes=["qwen2.5-7b", "qwen2.5-3b", "qwen2.5-1.5b", "qwen2.5-0.5b"], prompts=8, group=8,
                        prompt_len=128,
                        new_tokens=128, micro=16, warmup=1, steps=1),
    }


def planned_rows(name: str, p: Dict[str, Any]) -> List[str]:
    """The row ids a case measures, in order (the driver marks the ones a case did not reach)."""
    if name == "gemm":
        return ["bf16_gemm"]
    if name in ("methods", "actor_step"):
        return list(p["methods"])
    if name == "decode":
        return list(p["steps"])
    if name == "logprobs":
        return [f"{mode}/{n}/{path}" for n in p["tokens"] for mode in ("train", "nograd")
                for path in ("full_logits", "from_hidden")]
    if name == "largest":
        return list(p["shapes"])
    if name == "megatron":
        return ["logprob_floor", "logprob_vs_hf", "train_step", "offload"] + [f"plan_{rc}_mb{mb or p['micro']}" for rc, mb in PLAN_ROWS]
    raise KeyError(name)


def stats(xs: List[float]) -> Optional[Dict[str, float]]:
    """n, min, median and max of the measured repeats (None when there is none)."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None
    return {"n": len(xs), "min": min(xs), "median": float(statistics.median(xs)), "max": max(xs)}


def med(st: Optional[Dict[str, float]]) -> Optional[float]:
    return None if not st else st.get("median")


# ------------------------------------------------------------------ FLOPs (verl's count)
def dense_params(shape: Dict[str, Any]) -> int:
    """verl's ``dense_N``: attention + MLP matrices of every layer + ``2 V h`` (embedding and LM head)."""
    h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape.get("head_dim") or h // heads
    attn = h * (heads * hd + 2 * kv * hd + heads * hd)
    mlp = 3 * h * shape["intermediate_size"]
    return (attn + mlp) * shape["num_hidden_layers"] + 2 * shape["vocab_size"] * h


def train_flops(shape: Dict[str, Any], seqlens: List[int]) -> float:
    """Forward + backward FLOPs of training on sequences of these lengths (verl ``FlopsCounter``)."""
    h, heads, L = shape["hidden_size"], shape["num_attention_heads"], shape["num_hidden_layers"]
    hd = shape.get("head_dim") or h // heads
    return 6.0 * dense_params(shape) * sum(seqlens) + 12.0 * sum(s * s for s in seqlens) * hd * heads * L


def n_params(shape: Dict[str, Any]) -> int:
    """Parameters of the Qwen2 model (biases of q/k/v, norms; embedding counted once when tied)."""
    h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape.get("head_dim") or h // heads
    layer = h * (heads * hd + 2 * kv * hd) + (heads * hd + 2 * kv * hd) + heads * hd * h
    layer += 3 * h * shape["intermediate_size"] + 2 * h
    emb = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    return shape["num_hidden_layers"] * layer + emb + h


# ------------------------------------------------------------------ the per-case context
class Ctx:
    """One case's device, work folder, FLOP peaks, and its result file (rewritten after every row)."""

    def __init__(self, dry_run: bool, work: str, peak_tflops: Optional[float], gemm_tflops: Optional[float] = None,
                 out: Optional[str] = None, results: Optional[Dict[str, Any]] = None, case: str = ""):
        import torch

        self.torch = torch
        self.dry_run = dry_run
        self.work = work
        self.cuda = torch.cuda.is_available() and not dry_run
        self.device = "cuda" if self.cuda else "cpu"
        self.peak_tflops = peak_tflops
        self.gemm_tflops = gemm_tflops
        self.out, self.results, self.case = out, results if results is not None else {}, case
        self.rows_written = 0
        if self.cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            name = torch.cuda.get_device_name(0)
            if self.peak_tflops is None:
                self.peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        elif self.peak_tflops is None:
            self.peak_tflops = 1.0  # the rehearsal: a nominal 1 TFLOP/s, so that the MFU code path runs

    # ---- results: every row is on disk as soon as it is measured
    def flush(self) -> None:
        if self.out:
            from openrlhf_div.io import atomic_write_json

            atomic_write_json(self.out, self.results, indent=1, default=float)

    def row(self, res: Dict[str, Any], rid: str, row: Dict[str, Any]) -> None:
        """Record one measured row of ``res`` (this case's result) and rewrite the result file."""
        res.setdefault("rows", {})[rid] = row
        self.flush()
        self.rows_written += 1
        fault = os.environ.get(FAULT_ENV, "")
        if fault and fault.split(":")[0] == self.case and self.rows_written == int(fault.split(":")[1]):
            print(f"[gpu_bench] {FAULT_ENV}={fault}: killing this case's process after row {rid}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    # ---- device helpers
    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            self.sync()
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> Optional[float]:
        return self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    def allocated_gib(self) -> Optional[float]:
        return self.torch.cuda.memory_allocated() / 2**30 if self.cuda else None

    def free(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def mfu(self, flops: float, seconds: Optional[float]) -> Dict[str, Optional[float]]:
        """``mfu``: against the datasheet peak (verl's way); ``mfu_gemm``: against this run's GEMM peak."""
        if not seconds or seconds <= 0:
            return {"mfu": None, "mfu_gemm": None}
        achieved = flops / seconds / 1e12
        return {"mfu": achieved / self.peak_tflops if self.peak_tflops else None,
                "mfu_gemm": achieved / self.gemm_tflops if self.gemm_tflops else None}

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, self.torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _error(ctx: Ctx, exc: BaseException) -> Dict[str, Any]:
    import traceback

    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:],
            "oom": ctx.is_oom(exc)}


def _median(xs: List[float]) -> Optional[float]:
    return float(statistics.median(xs)) if xs else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_env():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")


# ------------------------------------------------------------------ a config-built model on disk
def model_dir(ctx: Ctx, shape_name: str) -> str:
    """A Hugging Face folder: Qwen2 config of ``shape_name``, random weights (bf16), and a word-level
    tokenizer with one token per vocabulary id (``t<id>``; 0 = pad, 1 = eos), so that anything the
    random model samples decodes."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = os.path.join(ctx.work, f"model_{shape_name}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    shape = SHAPES[shape_name]
    V = shape["vocab_size"]
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = Qwen2Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    hf_tok.save_pretrained(path)
    del model
    ctx.free()
    return path


def _register_random_task():
    from openrlhf_div.tasks import RewardResult, Task, register_task

    class HashReward(Task):
        """Reward 1 for half the responses (a CRC of the text): mixed groups from a random model."""

        name = "gpu_bench_hash"

        def prompt(self, example):
            return example["prompt"]

        def score(self, response, label):
            ok = zlib.crc32(response.encode()) % 2 == 1
            return RewardResult(1.0 if ok else 0.0, ok)

    register_task("gpu_bench_hash", lambda **kw: HashReward())


def _local_data(ctx: Ctx, shape_name: str, n_prompts: int, prompt_len: int, resp_len: int) -> Dict[str, str]:
    """Training prompts and synthetic D_pef anchor rows (JSONL) for the local engine."""
    import random

    V = SHAPES[shape_name]["vocab_size"]
    d = os.path.join(ctx.work, f"data_{shape_name}_{prompt_len}_{resp_len}")
    os.makedirs(os.path.join(d, "pef"), exist_ok=True)
    rng = random.Random(0)
    with open(os.path.join(d, "train.jsonl"), "w") as fh:
        for i in range(n_prompts):
            text = " ".join(f"t{rng.randrange(2, V)}" for _ in range(prompt_len))
            fh.write(json.dumps({"id": f"p{i}", "prompt": text, "label": "-"}) + "\n")
    with open(os.path.join(d, "pef", "d_pef.jsonl"), "w") as fh:
        for i in range(max(16, n_prompts)):
            fh.write(json.dumps({"id": f"a{i}", "prompt_ids": [rng.randrange(2, V) for _ in range(prompt_len)],
                                 "response_ids": [rng.randrange(2, V) for _ in range(resp_len - 1)] + [1],
                                 "ref_log_probs": [-math.log(V)] * resp_len}) + "\n")
    with open(os.path.join(d, "pef", "summary.json"), "w") as fh:
        json.dump({"temperature": 1.0, "synthetic": "benchmarks/gpu_bench.py"}, fh)
    return {"train": os.path.join(d, "train.jsonl"), "anchor": os.path.join(d, "pef", "d_pef.jsonl")}


def _local_trainer(ctx: Ctx, p: Dict[str, Any], shape_name: str, method: str, hooks=(), checkpointing=False):
    from openrlhf_div.engines.local.config import load_config
    from openrlhf_div.engines.local.trainer import Trainer

    _register_random_task()
    n_prompts = p["prompts"] * (p.get("warmup", 1) + p.get("steps", 1) + 1) * 4
    data = _local_data(ctx, shape_name, n_prompts, p["prompt_len"], p["new_tokens"])
    over = ["task=gpu_bench_hash", f"output_dir={ctx.work}/run_{shape_name}_{method}_{time.time_ns()}",
            f"model.path={model_dir(ctx, shape_name)}", "model.dtype=bfloat16", "model.master_weights=true",
            f"data.train={data['train']}", f"data.anchor={data['anchor']}", f"device={ctx.device}",
            f"rollout.prompts_per_step={p['prompts']}", f"rollout.group_size={p['group']}",
            f"rollout.max_new_tokens={p['new_tokens']}", f"optim.micro_batch_size={p['micro']}",
            "optim.steps=100", "eval.at_start=false", "logging.tensorboard=false", "logging.progress=false",
            "checkpoint.every=0", f"method.name={method}", "seed=1",
            f"model.gradient_checkpointing={'true' if checkpointing else 'false'}"]
    if not ctx.cuda:
        over.append("num_threads=1")
    return Trainer(load_config(None, over), hooks=hooks)




class _PhaseTimer:
    """Times the trainer's phases through its public ``phase_hooks`` (synchronised clocks) and
    collects the trained sequence lengths through its micro-batch ``hooks``."""

    def __init__(self, ctx: Ctx, trainer, shape: Dict[str, Any]):
        self.ctx, self.tr, self.shape = ctx, trainer, shape
        self.t: Dict[str, float] = {}
        self._t0: Dict[str, float] = {}
        self.seqlens: List[int] = []
        self.gen_tokens = 0
        trainer.phase_hooks.append(self._phase)
        trainer.hooks.append(self._hook)

    def _phase(self, name: str, start: bool, info: Dict[str, Any]) -> None:
        self.ctx.sync()
        now = time.perf_counter()
        if start:
            self._t0[name] = now
            return
        self.t[name] = self.t.get(name, 0.0) + now - self._t0.pop(name)
        if name == "generation":
            self.gen_tokens += int(info.get("tokens", 0))

    def _hook(self, info):
        exp = info["experience"]
        self.seqlens += [int(x) for x in exp.attention_mask[info["rows"]].sum(-1).tolist()]
        for a in info["anchors"]:  # D_pef records (engines.anchor_data.AnchorRecord)
            self.seqlens.append(len(a.prompt_ids) + len(a.response_ids))

    def step(self) -> Dict[str, Any]:
        self.t, self.seqlens, self.gen_tokens = {}, [], 0
        self.ctx.sync()
        t0 = time.perf_counter()
        st = self.tr.train_step()
        self.ctx.sync()
        total = time.perf_counter() - t0
        gen, lp, opt = self.t.get("generation", 0.0), self.t.get("logprobs", 0.0), self.t.get("optimizer", 0.0)
        train = float(st.get("time_train", 0.0))
        fwd_bwd = max(train - opt, 0.0)
        flops = train_flops(self.shape, self.seqlens)
        return {"step_s": total, "generation_s": gen, "logprobs_s": lp, "fwd_bwd_s": fwd_bwd, "optimizer_s": opt,
                "other_s": max(total - gen - lp - train, 0.0), "gen_tokens": self.gen_tokens,
                "gen_tokens_per_s": self.gen_tokens / gen if gen > 0 else None,
                "train_tokens": sum(self.seqlens), "train_flops": flops, "train_s": fwd_bwd + opt,
                "skipped": bool(st.get("skipped")), "kept_groups": st.get("kept_groups")}


STEP_KEYS = ("step_s", "generation_s", "logprobs_s", "fwd_bwd_s", "optimizer_s", "other_s", "gen_tokens_per_s",
             "train_tokens", "train_s")


def _summarise_steps(ctx: Ctx, steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    """n / min / median / max of every per-step figure; MFU from the median training time."""
    out: Dict[str, Any] = {k: stats([r[k] for r in steps if r.get(k) is not None]) for k in STEP_KEYS}
    flops = _median([r["train_flops"] for r in steps])
    out.update(ctx.mfu(flops or 0.0, med(out["train_s"])))
    out["skipped_steps"] = sum(1 for r in steps if r.get("skipped"))
    return out


def _timed_steps(ctx: Ctx, tr, shape, warmup: int, steps: int) -> Dict[str, Any]:
    """``warmup`` steps, then a peak-memory reset, then ``steps`` measured steps."""
    timer = _PhaseTimer(ctx, tr, shape)
    t0 = time.perf_counter()
    for _ in range(warmup):
        timer.step()
    warm = time.perf_counter() - t0
    ctx.reset_peak()
    rows = [timer.step() for _ in range(steps)]
    r = _summarise_steps(ctx, rows)
    r.update(warmup_steps=warmup, warmup_s=warm, peak_gib=ctx.peak_gib())
    return r


# ------------------------------------------------------------------ case: decode
def _word_tokenizer(V: int):
    """A word-level tokenizer with one token per vocabulary id (``t<id>``; 0 = pad, 1 = eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def case_decode(ctx: Ctx, p: Dict[str, Any], res: Dict[str, Any]) -> None:
    """The lean decoder's token step per ``decode_step`` (issue 41, item 6)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_div.engines.local.fastgen import make_decoder
    from openrlhf_div.engines.local.generation import generate, pack_sequences, position_ids_from_mask

    shape = SHAPES[p["shape"]]
    V, n = shape["vocab_size"], p["prompts"] * p["group"]
    res.update(shape=p["shape"], params=n_params(shape), dtype="bfloat16", n_rows=n,
               setup={k: p[k] for k in ("prompts", "group", "prompt_len", "new_tokens", "warmup", "repeats")})
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=None))
    model = model.to(torch.bfloat16).eval()
    tok = _word_tokenizer(V)
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, V, (p["prompt_len"],), generator=rng).tolist() for _ in range(p["prompts"])]
    rows = [q for q in prompts for _ in range(p["group"])]
    ids, attn, _ = pack_sequences(rows, [[] for _ in rows], 0, ctx.device)
    pos = position_ids_from_mask(attn)
    steps = p["new_tokens"] - 2   # timed steps (the cache holds prompt + new_tokens columns)

    @torch.no_grad()
    def bare_steps(step: str) -> float:
        """Seconds for ``steps`` decode steps after a prefill (greedy tokens, every row live)."""
        dec = make_decoder(model, n, ids.shape[1] + p["new_tokens"], None, step)
        logits = dec.prefill(ids, attn, pos)
        a, nxt = attn, pos[:, -1] + 1
        one = torch.ones(n, 1, dtype=torch.long, device=ctx.device)
        t0 = 0.0
        for i in range(steps + 1):   # the first step untimed (the graph's capture happens there)
            if i == 1:
                ctx.sync()
                t0 = time.perf_counter()
            t = logits.argmax(-1)
            if getattr(dec, "static", False):
                logits = dec.step(t, one, nxt)
            else:
                a = torch.cat([a, one], -1)
                logits = dec.step(t, a, nxt)
            nxt = nxt + 1
        ctx.sync()
        return time.perf_counter() - t0

    def sample(step: str):
        ctx.sync()
        t0 = time.perf_counter()
        g = torch.Generator(device=ctx.device).manual_seed(1)
        out = generate(model, tok, prompts, n_samples=p["group"], max_new_tokens=p["new_tokens"], temperature=1.0,
                       generator=g, decode_step=step)
        ctx.sync()
        return out, time.perf_counter() - t0

    outs: Dict[str, Any] = {}
    for step in p["steps"]:
        ctx.free()
        ctx.reset_peak()
        try:
            t0 = time.perf_counter()
            for _ in range(p["warmup"]):
                sample(step)
            warm = time.perf_counter() - t0
            step_s = [bare_steps(step) / steps for _ in range(p["repeats"])]
            gen = [sample(step) for _ in range(p["repeats"])]
            out = gen[-1][0]
            outs[step] = out
            toks = int(out.response_mask.sum())
            r: Dict[str, Any] = {"step_ms": stats([1e3 * x for x in step_s]),
                                 "generate_s": stats([g_[1] for g_ in gen]),
                                 "gen_tokens_per_s": stats([toks / g_[1] for g_ in gen]),
                                 "gen_tokens": toks, "warmup_s": warm, "peak_gib": ctx.peak_gib()}
            ref = outs.get("static" if step == "graph" else "dynamic")
            if ref is not None and step != "dynamic":
                same = [a_ == b_ for a_, b_ in zip(out.response_ids, ref.response_ids)]
                r["vs"] = "static" if step == "graph" else "dynamic"
                r["rows_same_tokens"] = f"{sum(same)}/{len(same)}"
                r["bit_exact"] = bool(all(same) and torch.equal(out.log_probs, ref.log_probs))
                if all(same):
                    r["max_abs_logprob_diff"] = float((out.log_probs - ref.log_probs).abs().max())
            base = (res.get("rows", {}).get("dynamic") or {}).get("step_ms")
            if base and step != "dynamic":
                r["step_speedup_vs_dynamic"] = med(base) / med(r["step_ms"])
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not hide the others
            r = _error(ctx, exc)
        ctx.row(res, step, r)
        print(f"[gpu_bench] decode/{step}: step_ms {json.dumps(r.get('step_ms'))} {r.get('error', '')[:300]}",
              flush=True)


# ------------------------------------------------------------------ case: methods
def case_methods(ctx: Ctx, p: Dict[str, Any], res: Dict[str, Any]) -> None:
    shape = SHAPES[p["shape"]]
    res.update(shape=p["shape"], params=n_params(shape),
               setup={k: p[k] for k in ("prompts", "group", "prompt_len", "new_tokens", "micro", "warmup", "steps")})
    for m in p["methods"]:
        ctx.free()
        ctx.reset_peak()
        tr = None
        try:
            tr = _local_trainer(ctx, p, p["shape"], m)
            r = _timed_steps(ctx, tr, shape, p["warmup"], p["steps"])
            r.update(reference_model=tr.ref_model is not None, anchor_rows=bool(tr.anchor_samples))
        except Exception as exc:  # noqa: BLE001 - one method's failure must not hide the others
            r = _error(ctx, exc)
        del tr
        ctx.row(res, m, r)
        print(f"[gpu_bench] methods/{m}: step_s {json.dumps(r.get('step_s'))} {r.get('error', '')[:300]}", flush=True)


# ------------------------------------------------------------------ case: largest
def case_largest(ctx: Ctx, p: Dict[str, Any], res: Dict[str, Any]) -> None:
    res["largest"] = None
    for i, name in enumerate(p["shapes"]):
        row: Dict[str, Any] = {"shape": name, "params": n_params(SHAPES[name])}
        # without gradient checkpointing first; out of memory: once more with it (the row says which)
        for ckpt in (False, True):
            ctx.free()
            ctx.reset_peak()
            tr = None
            try:
                tr = _local_trainer(ctx, p, name, "grpo", checkpointing=ckpt)
                s = _timed_steps(ctx, tr, SHAPES[name], p["warmup"], p["steps"])
                row.update(trains=True, gradient_checkpointing=ckpt, step_s=s["step_s"], mfu=s["mfu"],
                           mfu_gemm=s["mfu_gemm"], peak_gib=s["peak_gib"])
                row.pop("error", None)
                row.pop("oom", None)
            except Exception as exc:  # noqa: BLE001
                row.update(trains=False, gradient_checkpointing=ckpt, oom=ctx.is_oom(exc),
                           error=f"{type(exc).__name__}: {exc}"[:1000], peak_gib=ctx.peak_gib())
            finally:
                del tr
                ctx.free()
            if row["trains"] or not row.get("oom"):
                break
        shutil.rmtree(os.path.join(ctx.work, f"model_{name}"), ignore_errors=True)
        if row["trains"]:
            res["largest"] = name
            for smaller in p["shapes"][i + 1:]:
                res.setdefault("rows", {})[smaller] = {"not_needed": f"{name} trains"}
        ctx.row(res, name, row)
        print(f"[gpu_bench] largest/{name}: {json.dumps(row)[:300]}", flush=True)
        if row["trains"]:
            break


# ------------------------------------------------------------------ case: gemm
def case_gemm(ctx: Ctx, p: Dict[str, Any], res: Dict[str, Any]) -> None:
    """bf16 GEMM throughput: the peak this device reaches on the operation training is made of."""
    import torch

    n = p["n"]
    g = torch.Generator(device=ctx.device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=ctx.device).to(torch.bfloat16)
    b = torch.randn(n, n, generator=g, device=ctx.device).to(torch.bfloat16)
    for _ in range(p["warmup"]):
        a @ b
    tflops = []
    for _ in range(p["repeats"]):
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(p["inner"]):
            a @ b
        ctx.sync()
        dt = (time.perf_counter() - t0) / p["inner"]
        tflops.append(2.0 * n ** 3 / dt / 1e12)
    res["tflops_max"] = max(tflops)
    ctx.gemm_tflops = max(tflops)
    ctx.row(res, "bf16_gemm", {"n": n, "calls_per_repeat": p["inner"], "tflops": stats(tflops)})


# ------------------------------------------------------------------ case: logprobs
def case_logprobs(ctx: Ctx, p: Dict[str, Any], res: Dict[str, Any]) -> None:
    import torch

    from openrlhf_div.algorithms import log_probs_from_hidden

    dev, V, H = ctx.device, p["vocab"], p["hidden"]
    dtype = torch.bfloat16
    res.update(vocab=V, hidden=H, dtype="bfloat16", tf32=bool(ctx.cuda))
    g = torch.Generator(device=dev).manual_seed(0)
    W0 = (torch.randn(V, H, generator=g, device=dev) * 0.02).to(dtype)

    def full(h, W, t):
        logits = torch.nn.functional.linear(h, W).float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    def hidden_path(h, W, t):
        return log_probs_from_hidden(h, W, t, return_entropy=True)

    for n in p["tokens"]:
        h0 = torch.randn(n, H, generator=g, device=dev).to(dtype)
        t = torch.randint(0, V, (n,), generator=g, device=dev)
        for mode in ("train", "nograd"):
            for path, fn in (("full_logits", full), ("from_hidden", hidden_path)):
                row: Dict[str, Any] = {"tokens": n, "mode": mode, "path": path}
                times, peaks = [], []
                ctx.free()   # between rows only: the repeats reuse what the warm-up allocated
                try:
                    for rep in range(p["repeats"] + 1):   # the first is a warm-up
                        h = h0.clone().requires_grad_(mode == "train")
                        W = W0.clone().requires_grad_(mode == "train")
                        ctx.reset_peak()
                        base = ctx.allocated_gib()
                        t0 = time.perf_counter()
                        if mode == "train":
                            lp, ent = fn(h, W, t)
                            (lp.float().sum() + ent.float().sum()).backward()
                        else:
                            with torch.no_grad():
                                lp, ent = fn(h, W, t)
                        ctx.sync()
                        dt = time.perf_counter() - t0
                        if rep:
                            times.append(1e3 * dt)
                            if ctx.cuda:
                                peaks.append(ctx.peak_gib() - base)
                        del h, W, lp, ent
                    row.update(ms=stats(times), peak_above_inputs_gib=stats(peaks))
                except Exception as exc:  # noqa: BLE001
                    row.update(error=f"{type(exc).__name__}: {exc}"[:500], oom=ctx.is_oom(exc))
                    ctx.free()
                ctx.row(res, f"{mode}/{n}/{path}", row)
                print(f"[gpu_bench] logprobs: {json.dumps(row)}", flush=True)


# ------------------------------------------------------------------ case: actor_step (OpenRLHF + DeepSpeed)
# ------------------------------------------------------------------ case: actor_step (OpenRLHF + DeepSpeed)
def _ds_args(method: str, micro: int, batch: int, zero: int):
    from types import SimpleNamespace as NS

    return NS(
        ds=NS(param_dtype="bf16", zero_stage=zero, adam_offload=False, zpg=1, use_universal_ckpt=False,
              grad_accum_dtype=None, overlap_comm=False, deepcompile=False, tensor_parallel_size=1, ring_attn_size=1,
              packing_samples=False, attn_implementation="sdpa"),
        train=NS(dynamic_batch_enable=False, max_epochs=1, seed=0, colocate_all=False, async_enable=False,
                 micro_batch_size=micro, batch_size=batch, full_determinism_enable=False),
        actor=NS(eps_clip_low_high=(0.2, 0.2), dual_clip=None, loss_agg_mode="token-mean", policy_loss_type="ppo",
                 aux_loss_coef=0, entropy_coef=None, adam=NS(lr=1e-6)),
        algo=NS(advantage=NS(is_correction_level="off", is_correction_mode="mask", is_correction_gating="ratio",
                             is_correction_threshold=(0.5, 5.0)), kl=NS(use_loss=False)),
        vllm=NS(sync_backend="nccl"), local_rank=-1, div=NS(method=method, anchor_data=None))


def _synthetic_experience(n, T, P, V, method, seed, device):
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience

    from openrlhf_div.engines.contract import ANCHOR_FLAG, CORRECT_FLAG

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(2, V, (n, T), generator=g).to(device)
    attn = torch.ones(n, T, dtype=torch.long, device=device)
    am = torch.zeros(n, T - 1, dtype=torch.bool, device=device)
    am[:, P - 1:] = True
    anchor = torch.zeros(n, device=device)
    if method.needs.anchor_batch and seed % 2 == 1:
        anchor[: n // 2] = 1.0  # half the rows of every other micro-batch are D_pef anchors
    lp = -math.log(V) * torch.ones(n, T - 1, device=device)
    adv = (torch.randn(n, T - 1, generator=g) * am.cpu()).to(device)
    f = dict(device=device)
    return Experience(sequences=seq, attention_mask=attn, action_mask=am, action_log_probs=lp,
                      base_action_log_probs=lp.clone(), advantages=adv, returns=adv.clone(),
                      rewards=torch.zeros(n, **f), scores=torch.zeros(n, **f),
                      response_length=torch.full((n,), float(T - P), **f),
                      truncated=torch.zeros(n, dtype=torch.bool, **f),
                      total_length=torch.full((n,), float(T), **f), index=list(range(n)),
                      prompts=[""] * n, labels=[""] * n, images=[None] * n, mm_train_inputs=[None] * n,
                      info={ANCHOR_FLAG: anchor, CORRECT_FLAG: torch.ones(n, **f)})


def _one_actor_step(ctx: Ctx, p: Dict[str, Any], shape, path: str, method, torch_adam: bool) -> Dict[str, Any]:
    import torch
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    from openrlhf_div.engines.openrlhf.actor import DivActorPPOTrainer
    from openrlhf_div.engines.openrlhf.logprob_actor import HiddenLogProbActor

    micro, batch, T, P = p["micro"], p["batch"], p["seq"], p["prompt"]
    strategy = DeepspeedStrategy(seed=0, micro_train_batch_size=micro, train_batch_size=batch,
                                 zero_stage=p["zero_stage"], args=_ds_args(method.name, micro, batch, p["zero_stage"]))
    if torch_adam:  # the fallback when FusedAdam's JIT build failed
        upstream = strategy.get_ds_train_config

        def ds_config(*a, **k):
            cfg = upstream(*a, **k)
            if "optimizer" in cfg:
                cfg["optimizer"].setdefault("params", {})["torch_adam"] = True
            return cfg

        strategy.get_ds_train_config = ds_config
    strategy.setup_distributed()  # CUDA: set_device, NCCL, the "cuda" device mesh
    actor = HiddenLogProbActor(path, attn_implementation="sdpa", param_dtype="bf16",
                               ds_config=strategy.get_ds_train_config())
    cfg = dict(optim="adam", adam=dict(lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
               lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.1, max_norm=1.0, scheduler_steps=100)
    actor, optim, sched = strategy.prepare((actor, cfg))
    trainer = DivActorPPOTrainer(strategy, actor, ema_model=None, actor_optim=optim, actor_scheduler=sched,
                                 micro_train_batch_size=micro, tokenizer=None, vllm_engines=None, method=method)
    dev = torch.cuda.current_device() if ctx.cuda else "cpu"
    for i in range(batch // micro):
        trainer.replay_buffer.append(_synthetic_experience(micro, T, P, shape["vocab_size"], method, i, dev))
    times, status, warm = [], None, 0.0
    for k in range(p["warmup"] + p["steps"]):
        if k == p["warmup"]:
            ctx.reset_peak()
        ctx.sync()
        t0 = time.perf_counter()
        status = trainer.ppo_train(0.0)
        ctx.sync()
        if k >= p["warmup"]:
            times.append(time.perf_counter() - t0)
        else:
            warm += time.perf_counter() - t0
    step = stats(times)
    out = dict(step_ms={k: (v if k == "n" else 1e3 * v) for k, v in step.items()},
               tokens_per_s=batch * T / step["median"], warmup_s=warm, peak_gib=ctx.peak_gib(),
               optimizer=type(getattr(optim, "optimizer", optim)).__name__,
               policy_loss=float(status.get("policy_loss", float("nan"))) if isinstance(status, dict) else None)
    out.update(ctx.mfu(train_flops(shape, [T] * batch), step["median"]))
    del trainer, actor, optim, sched
    return out


def case_actor_step(ctx: Ctx, p: Dict[str, Any], res: Dict[str, Any]) -> None:
    from openrlhf_div.compat import install_flash_attn_standin, install_vllm_stub

    import ray_import_stub  # benchmarks/: Ray's wheel is too large to carry; one process starts no actor

    stubs = {"flash_attn": install_flash_attn_standin(), "ray": ray_import_stub.install(),
             "vllm": install_vllm_stub()}
    if not ctx.cuda:  # the rehearsal: DeepSpeed's CPU accelerator (OpenRLHF's CUDA-only calls: gpu_bench.sh's seams)
        os.environ["DS_ACCELERATOR"] = "cpu"
    _dist_env()
    from openrlhf_div.algorithms import get_method

    shape = SHAPES[p["shape"]]
    path = model_dir(ctx, p["shape"])
    res.update(shape=p["shape"], params=n_params(shape), zero_stage=p["zero_stage"], micro=p["micro"],
               batch=p["batch"], seq=p["seq"], prompt=p["prompt"], stubs=stubs)
    fused_error = None
    for name in p["methods"]:
        ctx.free()
        method = get_method(name)
        r: Dict[str, Any] = {}
        for torch_adam in ((False, True) if ctx.cuda else (False,)):
            if torch_adam and fused_error is None:
                break
            try:
                r = _one_actor_step(ctx, p, shape, path, method, torch_adam or fused_error is not None)
                if fused_error is not None:
                    r["fused_adam_error"] = fused_error
                break
            except Exception as exc:  # noqa: BLE001
                r = _error(ctx, exc)
                # FusedAdam is JIT-compiled on first use: if that build fails, measure with torch's Adam
                if ctx.cuda and fused_error is None and any(k in r["traceback"] for k in (
                        "fused_adam", "op_builder", "ninja", "nvcc", "cpp_extension")):
                    fused_error = r["error"][:500]
                    ctx.free()
                    continue
                break
        ctx.row(res, name, r)
        print(f"[gpu_bench] actor_step/{name}: {json.dumps({k: v for k, v in r.items() if k != 'traceback'})[:400]}",
              flush=True)


# ------------------------------------------------------------------ case: megatron
def _megatron_plan(layout, mcfg, seq: int, micro: int, attention: str) -> Dict[str, float]:
    """``openrlhf-div plan-memory``'s figures for this layout, with the attention the engine runs."""
    from openrlhf_div.engines.megatron.memory_plan import estimate_memory

    out = estimate_memory(layout, mcfg, dp=1, seq_len=seq, micro_batch=micro, overhead_gib=0.0,
                          attention=attention).as_gib()
    out["attention"] = attention
    return out


def hf_log_probs(model, seq, am):
    """``[B, T-1]`` log-probs of ``seq``'s next tokens under a Hugging Face causal LM (float32 softmax)."""
    import torch

    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(seq.to(dev), attention_mask=am.to(dev)).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, seq.to(dev)[:, 1:, None])[..., 0].cpu()


def logprob_noise_floor(model, seq, am, act) -> Dict[str, Any]:
    """``|log p_bf16 - log p_fp32|`` over the response positions ``act``: ``model``'s weights as they
    are (bf16) against the same weights upcast to float32, on the same tokens: the disagreement
    bf16 alone causes, the floor under any bf16 log-prob comparison (docs/benchmarks.md)."""
    import copy

    import torch

    from openrlhf_div.algorithms._utils import masked_agreement

    low = hf_log_probs(model, seq, am)
    full = copy.deepcopy(model).to(torch.float32)
    high = hf_log_probs(full, seq, am)
    del full
    return dict(masked_agreement(low, high, act, "bf16 vs float32 log-probs"),
                tokens=int(act.sum()), mean_log_prob=float((high * act).sum() / act.sum()))


def _plan_error(peak: Optional[float], plan: Dict[str, Any]) -> Optional[float]:
    """(planned - measured) / measured peak; None without a measured peak (the CPU rehearsal)."""
    return (plan["total"] - peak) / peak if peak else None


#: the planner-vs-card rows after the step (recompute, rows per micro-batch): the train_step row is
#: (none, micro); these vary one thing each
PLAN_ROWS = (("none", 1), ("full", 0), ("full", 1))   # 0: the plan's micro


def case_megatron(ctx: Ctx, p: Dict[str, Any], res: Dict[str, Any]) -> None:
    import megatron.core
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_div.algorithms import get_method
    from openrlhf_div.algorithms._utils import masked_agreement
    from openrlhf_div.engines.megatron.config import MegatronConfig
    from openrlhf_div.engines.megatron.engine import MegatronEngine, OptimSettings, init_megatron_parallel
    from openrlhf_div.engines.megatron.loss import MicroBatch
    from openrlhf_div.engines.megatron.model import use_transformer_engine
    from openrlhf_div.engines.megatron.offload import training_state_tensors

    _dist_env()
    if not ctx.cuda:   # the rehearsal: full recomputation saves / restores the CUDA RNG state; the CPU's stands in
        import megatron.core.tensor_parallel.random as mc_random

        mc_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        mc_random._set_cuda_rng_state = lambda *a, **k: None
        import megatron.core.fusions.fused_softmax as mc_softmax   # (its causal mask, rebuilt in the recomputation)

        mc_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    mcfg = MegatronConfig(tp=1, pp=1, bf16=True, distributed_optimizer=True)
    init_megatron_parallel(mcfg, seed=1)
    shape = SHAPES[p["shape"]]
    micro, n_micro, T, P = p["micro"], p["n_micro"], p["seq"], p["prompt"]
    hf_cfg = Qwen2Config(**shape, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        hf = Qwen2ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    optim = OptimSettings(optimizer="adam", lr=1e-6, lr_scheduler="constant", warmup_ratio=0.0, max_steps=100)
    eng = MegatronEngine(mcfg, hf_config=hf_cfg, hf_weights=hf.state_dict(), train=True, method=get_method("grpo"),
                         optim=optim)
    res.update(shape=p["shape"], params=n_params(shape), megatron_core=megatron.core.__version__,
               transformer_engine_spec=use_transformer_engine(mcfg), micro=micro, n_micro=n_micro, seq=T, prompt=P)
    g = torch.Generator().manual_seed(3)
    V = shape["vocab_size"]

    def batch(B, L, seed):
        gg = torch.Generator().manual_seed(seed)
        seq = torch.randint(2, V, (B, L), generator=gg)
        am = torch.ones(B, L, dtype=torch.long)
        act = torch.zeros(B, L - 1)
        act[:, P - 1:] = 1
        return seq, am, act

    # the noise floor: the same HF weights in bf16 vs float32 on the same tokens (what bf16 alone moves)
    seq, am, act = batch(p["lp_rows"], p["lp_seq"], 0)
    try:
        floor_row = dict(logprob_noise_floor(hf, seq, am, act), dtype="bfloat16 vs float32")
    except Exception as exc:  # noqa: BLE001
        floor_row = _error(ctx, exc)
    ctx.free()
    ctx.row(res, "logprob_floor", floor_row)
    # log-probs of the engine vs the HF model (bf16), before the HF copy is freed; the batch is the
    # plan's (lp_seq > prompt: a response to compare; an empty mask is refused, never compared)
    lp, _ = eng.forward_log_probs(seq, am, act)
    ref = hf_log_probs(hf, seq, am) * act
    tol, tol_source = LOGPROB_TOL_BF16, LOGPROB_TOL_SOURCE
    if floor_row.get("max_abs"):   # this run's floor, on this device
        tol = round(LOGPROB_TOL_FACTOR * floor_row["max_abs"], 3)
        tol_source = f"2 x this run's bf16-vs-float32 noise floor (max {floor_row['max_abs']:.4f})"
    lp_row = dict(masked_agreement(lp.float().cpu(), ref, act, "megatron log-probs vs the HF model"),
                  tolerance=tol, tolerance_source=tol_source)
    if lp_row["max_abs"] >= tol:
        lp_row["error"] = f"log-probs differ from the HF model by {lp_row['max_abs']:.3f} (tolerance {tol})"
    hf_weights = {k: v.detach().to("cpu") for k, v in hf.state_dict().items()}   # for the planner rows' engines
    del hf, ref
    ctx.free()
    ctx.row(res, "logprob_vs_hf", lp_row)

    attention = "te" if use_transformer_engine(mcfg) else "local"

    def micro_batches(engine, rows):
        mbs = []
        for i in range(n_micro):
            s, a, m = batch(rows, T, 10 + i)
            old, _ = engine.forward_log_probs(s, a, m)
            adv = torch.randn(rows, generator=g)[:, None] * m
            mbs.append(MicroBatch(sequences=s, attention_mask=a, action_mask=m, old_log_probs=old, advantages=adv))
        return mbs

    mbs = micro_batches(eng, micro)
    times, metrics, warm = [], {}, 0.0
    for k in range(p["warmup"] + p["steps"]):
        if k == p["warmup"]:
            ctx.reset_peak()
        ctx.sync()
        t0 = time.perf_counter()
        metrics = eng.train_step(mbs)
        ctx.sync()
        if k >= p["warmup"]:
            times.append(time.perf_counter() - t0)
        else:
            warm += time.perf_counter() - t0
    st = stats(times)
    tokens = micro * n_micro * T
    row = dict(step_ms={k: (v if k == "n" else 1e3 * v) for k, v in st.items()}, tokens_per_s=tokens / st["median"],
               warmup_s=warm, peak_gib=ctx.peak_gib(), loss=metrics.get("loss"),
               grad_norm=metrics.get("actor_grad_norm"), recompute=mcfg.recompute,
               plan_gib=_megatron_plan(eng.layout, mcfg, T, micro, attention))
    row["plan_error"] = _plan_error(row["peak_gib"], row["plan_gib"])
    row.update(ctx.mfu(train_flops(shape, [T] * micro * n_micro), st["median"]))
    ctx.row(res, "train_step", row)

    # offload / reload: frees the optimizer state and gradients, restores them bit for bit
    keep, _, _ = training_state_tensors(eng.model, eng.optimizer)
    before_state = [t.detach().clone() for t in keep]
    ctx.sync()
    before = torch.cuda.memory_allocated() if ctx.cuda else 0
    freed = eng.offload()
    ctx.sync()
    drop = before - torch.cuda.memory_allocated() if ctx.cuda else None
    eng.reload()
    keep, _, _ = training_state_tensors(eng.model, eng.optimizer)
    exact = len(keep) == len(before_state) and all(torch.equal(a, b) for a, b in zip(before_state, keep))
    off = {"freed_bytes": freed, "allocated_drop_bytes": drop, "state_bit_exact": bool(exact)}
    if not exact:
        off["error"] = "the optimizer state after offload + reload is not bit-exact"
    ctx.row(res, "offload", off)

    # the planner against the card at more layouts: one step each (after a warm-up step), peak reset
    for rc, rows in PLAN_ROWS:
        rows = rows or micro
        rid = f"plan_{rc}_mb{rows}"
        try:
            if rc != mcfg.recompute:
                del eng, mbs
                ctx.free()
                mcfg = MegatronConfig(tp=1, pp=1, bf16=True, distributed_optimizer=True, recompute=rc)
                eng = MegatronEngine(mcfg, hf_config=hf_cfg, hf_weights=hf_weights, train=True,
                                     method=get_method("grpo"), optim=optim)
                mbs = []
            layout_mbs = micro_batches(eng, rows)
            eng.train_step(layout_mbs)
            ctx.reset_peak()
            t0 = time.perf_counter()
            eng.train_step(layout_mbs)
            ctx.sync()
            pr = dict(recompute=rc, micro=rows, n_micro=n_micro, seq=T, step_s=time.perf_counter() - t0,
                      peak_gib=ctx.peak_gib(), plan_gib=_megatron_plan(eng.layout, mcfg, T, rows, attention))
            pr["plan_error"] = _plan_error(pr["peak_gib"], pr["plan_gib"])
            del layout_mbs
        except Exception as exc:  # noqa: BLE001 - one layout's failure must not hide the others
            pr = dict(_error(ctx, exc), recompute=rc, micro=rows)
        ctx.row(res, rid, pr)
        print(f"[gpu_bench] megatron/{rid}: {json.dumps({k: v for k, v in pr.items() if k != 'traceback'})[:300]}",
              flush=True)
    dist.destroy_process_group()


RUNNERS = {"gemm": case_gemm, "methods": case_methods, "logprobs": case_logprobs, "decode": case_decode,
           "actor_step": case_actor_step,
           "megatron": case_megatron, "largest": case_largest}


def row_ok(name: str, r: Dict[str, Any]) -> bool:
    """A row counts as measured: no error, not unreached (an out-of-memory answer is a measurement
    in ``largest`` and ``logprobs``: it says what does not fit)."""
    if "not_reached" in r:
        return False
    if "not_needed" in r:
        return True
    if r.get("error"):
        return name in ("largest", "logprobs") and bool(r.get("oom"))
    return True


def case_ok(name: str, res: Dict[str, Any], planned: List[str]) -> bool:
    rows = res.get("rows", {})
    if res.get("error") or res.get("partial") or any(rid not in rows for rid in planned):
        return False
    if name == "largest" and res.get("largest") is None and not all(r.get("oom") for r in rows.values()):
        return False
    return all(row_ok(name, rows[rid]) for rid in planned)


# ------------------------------------------------------------------ one case (child process)
def run_case(names: List[str], dry_run: bool, out: str, peak_tflops: Optional[float],
             gemm_tflops: Optional[float] = None) -> int:
    """Run ``names`` one after the other in this process; ``out`` holds ``{case: result}``, rewritten
    after every row (``partial`` until the case returns)."""
    import torch

    results: Dict[str, Any] = {}
    for name in names:
        res: Dict[str, Any] = {"partial": True, "rows": {}}
        results[name] = res
        with tempfile.TemporaryDirectory(prefix=f"gpu_bench_{name}_") as work:
            ctx = Ctx(dry_run, work, peak_tflops, gemm_tflops, out=out, results=results, case=name)
            if not dry_run and not ctx.cuda:
                print("[gpu_bench] no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
                return 2
            res.update(peak_tflops=ctx.peak_tflops,
                       device=torch.cuda.get_device_name(0) if ctx.cuda else "cpu (dry run)")
            ctx.flush()
            t0 = time.perf_counter()
            try:
                RUNNERS[name](ctx, plan(dry_run)[name], res)
            except Exception as exc:  # noqa: BLE001
                res.update(_error(ctx, exc))
            res["case_s"] = time.perf_counter() - t0
            res["gemm_tflops"] = ctx.gemm_tflops
            gemm_tflops = ctx.gemm_tflops   # later cases of this process (a dry-run group) use it
            res["partial"] = False
            ctx.flush()
    return 0


# ------------------------------------------------------------------ the driver
def _child_cmd(names: List[str], dry_run: bool, out: str, peak: Optional[float], gemm: Optional[float],
               record: Optional[str]) -> List[str]:
    argv = [os.path.abspath(__file__), "--case", ",".join(names), "--case-out", out]
    if dry_run:
        argv.append("--dry-run")
    if peak:
        argv += ["--peak-tflops", str(peak)]
    if gemm:
        argv += ["--gemm-tflops", str(gemm)]
    view = os.environ.get("OPENRLHF_DIV_DEVICE_VIEW")
    if view:  # keep the children inside the device view (benchmarks/gpu_kit.py device-view)
        cmd = [sys.executable, "-S", os.path.join(ROOT, "benchmarks", "gpu_kit.py"), "_exec", view]
        if record:
            cmd += ["--record", record]
        return cmd + ["--", *argv]
    return [sys.executable, *argv]


def _first_line(cmd: List[str]) -> Optional[str]:
    exe = shutil.which(cmd[0])
    if not exe:
        return None
    try:
        r = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    return lines[-1].strip() if cmd[0] == "nvcc" and lines else (lines[0].strip() if lines else None)


def preflight() -> Dict[str, Any]:
    """What the cases will need, checked before any runs: the GPU and its driver, the tools of
    DeepSpeed's FusedAdam JIT build (nvcc, g++, ninja, Python.h), and the library versions.
    Warnings only: a missing JIT tool means ``actor_step`` measures torch's Adam (it says so)."""
    import sysconfig

    info: Dict[str, Any] = {"gpu": None, "driver": None, "warnings": []}
    smi = _first_line(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if smi:
        parts = [x.strip() for x in smi.split(",")]
        info["gpu"] = ", ".join(parts[:2])
        info["driver"] = parts[2] if len(parts) > 2 else None
    for tool, cmd in (("nvcc", ["nvcc", "--version"]), ("g++", ["g++", "--version"]), ("ninja", ["ninja", "--version"])):
        info[tool] = _first_line(cmd)
    info["CUDA_HOME"] = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    inc = sysconfig.get_paths().get("include") or ""
    info["Python.h"] = os.path.join(inc, "Python.h") if os.path.exists(os.path.join(inc, "Python.h")) else None
    from importlib import metadata

    for dist in ("torch", "transformers", "numpy", "deepspeed", "megatron-core", "openrlhf"):
        try:   # the installed versions, without importing them into the driver
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
            info["warnings"].append(f"{dist} is not installed: the cases that need it will fail (say which)")
    missing = [k for k in ("nvcc", "g++", "ninja", "Python.h") if not info[k]]
    if missing:
        info["warnings"].append(f"DeepSpeed's FusedAdam JIT build lacks {', '.join(missing)}: actor_step will "
                                "measure torch's Adam instead (the row says so)")
    return info


def environment() -> Dict[str, Any]:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": "cpu"}
    # not torch.cuda.get_device_name: the driver must not hold a CUDA context while the cases run
    smi = _first_line(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if smi:
        info["device"] = smi
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    info["commit"] = checkout_commit()
    return info


def checkout_commit(root: str = ROOT) -> str:
    """The commit of this checkout's own repository (its own ``.git``), else "unknown": a plain copy
    inside another repository must not report that one's commit (the first GPU run did)."""
    from openrlhf_div.engines.local.runlog import own_commit

    return own_commit(root, short=True) or "unknown"


def _run_child(cmd: List[str], timeout: float) -> str:
    """Run a case process in its own session; kill the whole group at ``timeout``. Returns why it
    ended, for the rows it did not reach."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"the case was killed at its time limit ({timeout:.0f} s)"
    except BaseException:   # the driver interrupted: its case (in its own session) goes with it
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if rc < 0:
        return f"the case process died (signal {-rc})"
    return f"the case process exited {rc}"


def _write(a, res: Dict[str, Any]) -> None:
    from openrlhf_div.io import atomic_write_json, atomic_write_text

    atomic_write_json(os.path.join(a.results, "gpu_bench.json"), res, indent=1, default=float)
    atomic_write_text(os.path.join(a.results, "gpu_bench.md"), render([res]))


def drive(a) -> int:
    dry = a.dry_run
    names = a.cases.split(",") if a.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown or len(set(names)) != len(names):
        print(f"[gpu_bench] --cases {a.cases}: unknown or repeated case(s) {unknown or names}; valid: "
              f"{', '.join(CASES)} (in the order they should run)", file=sys.stderr)
        return 2
    os.makedirs(a.results, exist_ok=True)
    p = plan(dry)
    est = estimates()
    need_total = sum(est[n]["s"] for n in names)
    res: Dict[str, Any] = {"dry_run": dry, "environment": environment(), "plan": {n: p[n] for n in names},
                           "order": names, "budget_s": a.budget_s,
                           "estimates_s": {n: est[n] for n in names},
                           "command": " ".join(["benchmarks/gpu_bench.sh", *a.argv_for_record]), "cases": {}}
    print(f"[gpu_bench] cases in order: {', '.join(names)}; estimates {need_total:.0f} s of --budget-s "
          f"{a.budget_s:.0f}", flush=True)
    if not dry and need_total > (1 - SLACK) * a.budget_s:
        print(f"[gpu_bench] note: the estimates leave less than {SLACK:.0%} of the budget; the last cases may "
              "not be reached (their rows say so)", flush=True)
    res["preflight"] = preflight()
    print("[gpu_bench] pre-flight: " + json.dumps(res["preflight"]), flush=True)
    for w in res["preflight"]["warnings"]:
        print(f"[gpu_bench] WARNING: {w}", flush=True)
    t_start = time.perf_counter()
    if dry:
        groups: List[List[str]] = []
        for n in names:   # a dry-run group runs where its first case comes in the order
            g = next(gr for gr in DRY_RUN_GROUPS if n in gr)
            if not any(n in x for x in groups):
                groups.append([m for m in names if m in g])
    else:
        groups = [[n] for n in names]
    _write(a, res)
    for group in groups:
        left = a.budget_s - (time.perf_counter() - t_start)
        need = sum(est[n]["s"] for n in group)
        label = "+".join(group)
        gemm = (res["cases"].get("gemm") or {}).get("tflops_max")
        if not dry and left < 0.5 * need:
            why = (f"budget: {left:.0f} s left of --budget-s {a.budget_s:.0f}, the case needs ~{need:.0f} s; "
                   f"run it first with --cases {group[0]},...")
            for n in group:
                res["cases"][n] = {"ok": False, "not_run": why,
                                   "rows": {rid: {"not_reached": why} for rid in planned_rows(n, p[n])}}
            print(f"[gpu_bench] {label}: not run ({why})", flush=True)
            _write(a, res)
            continue
        case_out = os.path.join(a.results, f".case_{label}.json")
        record = os.path.join(a.results, f"imports_{label}.json") if a.record_imports else None
        cmd = _child_cmd(group, dry, case_out, a.peak_tflops, gemm, record)
        timeout = max(min(a.case_timeout_s * len(group), left), 30.0)
        print(f"[gpu_bench] {label}: running (estimate {need:.0f} s, killed after {timeout:.0f} s)", flush=True)
        t0 = time.perf_counter()
        ended = _run_child(cmd, timeout)
        try:
            with open(case_out) as fh:
                got = json.load(fh)
        except (OSError, ValueError):
            got = {}
        wall = time.perf_counter() - t0
        for n in group:
            r = got.get(n) or {"partial": True, "rows": {}}
            planned = planned_rows(n, p[n])
            done = [rid for rid in planned if rid in r.get("rows", {})]
            if r.get("partial"):
                r["ended"] = f"{ended} after {len(done)} of {len(planned)} rows"
            for rid in planned:
                if rid not in r.setdefault("rows", {}):
                    r["rows"][rid] = {"not_reached": r.get("ended") or r.get("error") or ended}
            r["rows"] = {rid: r["rows"][rid] for rid in planned}   # the planned order
            r["ok"] = case_ok(n, r, planned)
            r["wall_s"] = wall if len(group) == 1 else r.get("case_s", wall)
            res["cases"][n] = r
            print(f"[gpu_bench] {n}: {'ok' if r['ok'] else 'NOT OK'} in {r['wall_s']:.0f} s ({len(done)} of "
                  f"{len(planned)} rows measured{'; ' + r['ended'] if r.get('ended') else ''})", flush=True)
        if os.path.exists(case_out):
            os.remove(case_out)
        res["total_s"] = time.perf_counter() - t_start
        _write(a, res)
    print(f"[gpu_bench] wrote {os.path.join(a.results, 'gpu_bench.json')} and gpu_bench.md", flush=True)
    return 0 if all(r.get("ok") for r in res["cases"].values()) else 1


# ------------------------------------------------------------------ markdown
def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def _fs(st: Optional[Dict[str, float]], fmt="{:.2f}") -> str:
    """``median (min-max, n)`` of a figure's repeats."""
    if not st:
        return "-"
    return f"{fmt.format(st['median'])} ({fmt.format(st['min'])}-{fmt.format(st['max'])}, n={st['n']})"


def _unmeasured(r: Dict[str, Any]) -> Optional[str]:
    if "not_reached" in r:
        return f"not reached: {r['not_reached'][:160]}"
    if r.get("error"):
        return "out of memory" if r.get("oom") else f"failed: {r['error'][:160]}"
    return None


def render(results: List[Dict[str, Any]]) -> str:
    """The docs section from one or more results (later ones win per case)."""
    cases: Dict[str, Any] = {}
    envs, cmds, dry = [], [], False
    for r in results:
        cases.update(r.get("cases", {}))
        envs.append(r.get("environment", {}))
        cmds.append(r.get("command", ""))
        dry = dry or r.get("dry_run", False)
    L = [BEGIN, ""]
    if dry:
        L += ["**Dry run on a CPU at toy sizes: these figures are not GPU measurements.**", ""]
    for e, c in zip(envs, cmds):
        L.append(f"`{c}` on {e.get('device')} (torch {e.get('torch')}, CUDA {e.get('cuda')}, Python "
                 f"{e.get('python')}, transformers {e.get('transformers')}), {e.get('date')}, commit {e.get('commit')}.")
    peak = next((c.get("peak_tflops") for c in cases.values() if c.get("peak_tflops")), None)
    gemm = (cases.get("gemm") or {}).get("tflops_max")
    L += ["", "Figures: median (min-max, n = measured repeats after warm-up; the device synchronised before every "
              "clock read; peak memory reset per row). MFU: verl's count (6 x dense parameters incl. embedding "
              "and LM head x trained tokens, prompt included, + attention's 12 s^2 d heads layers) / training "
              f"time, divided by the datasheet's dense bf16 peak ({_f(peak, '{:.3g}')} TFLOP/s: **MFU**) and by "
              f"the bf16 GEMM peak measured in this run ({_f(gemm, '{:.3g}')} TFLOP/s: **MFU vs GEMM**).", ""]
    g = cases.get("gemm")
    if g:
        row = g.get("rows", {}).get("bf16_gemm", {})
        why = _unmeasured(row)
        L += [f"**bf16 GEMM** ({row.get('n', '?')} x {row.get('n', '?')} @ {row.get('n', '?')} x {row.get('n', '?')}): "
              + (why or f"{_fs(row.get('tflops'), '{:.1f}')} TFLOP/s"), ""]
    a = cases.get("actor_step")
    if a:
        L += [f"**OpenRLHF DeepSpeed ZeRO-{a.get('zero_stage')} actor step** ({a.get('shape')}, "
              f"{a.get('batch')} x {a.get('seq')} tokens per optimizer step, micro-batch {a.get('micro')})", "",
              "| method | step ms | tokens/s | MFU | MFU vs GEMM | peak GiB | warm-up s (incl. JIT build) | optimizer |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
        for name, r in a.get("rows", {}).items():
            why = _unmeasured(r)
            if why:
                L.append(f"| {name} | {why} |" + " |" * 6)
                continue
            L.append(f"| {name} | {_fs(r.get('step_ms'), '{:.0f}')} | {_f(r.get('tokens_per_s'), '{:,.0f}')} | "
                     f"{_f(r.get('mfu'), '{:.1%}')} | {_f(r.get('mfu_gemm'), '{:.1%}')} | {_f(r.get('peak_gib'))} | "
                     f"{_f(r.get('warmup_s'), '{:.0f}')} | {r.get('optimizer')}"
                     + (f" (FusedAdam failed: {r['fused_adam_error'][:100]})" if r.get("fused_adam_error") else "")
                     + " |")
        L.append("")
    mg = cases.get("megatron")
    if mg:
        rows = mg.get("rows", {})
        L += [f"**Megatron actor, TP=1** ({mg.get('shape')}, megatron-core {mg.get('megatron_core')}, "
              f"{'Transformer Engine' if mg.get('transformer_engine_spec') else 'local'} layer spec; "
              f"{mg.get('n_micro')} micro-batches of {mg.get('micro')} x {mg.get('seq')} tokens per step)", ""]
        fl = rows.get("logprob_floor")
        if fl is not None:
            L.append("- log-prob noise floor (the HF model in bf16 vs the same weights in float32, same tokens): "
                     + (_unmeasured(fl) or f"max abs {_f(fl.get('max_abs'), '{:.3f}')}, mean abs "
                                           f"{_f(fl.get('mean_abs'), '{:.4f}')} over {fl.get('n')} tokens"))
        lp = rows.get("logprob_vs_hf", {})
        L.append("- log-probs vs the HF model: " + (_unmeasured(lp) or f"max abs {_f(lp.get('max_abs'), '{:.3f}')}, "
                                                    f"mean abs {_f(lp.get('mean_abs'), '{:.4f}')}"
                                                    + (f" (tolerance {lp['tolerance']})" if lp.get("tolerance") else "")))
        ts = rows.get("train_step", {})
        pl = ts.get("plan_gib") or {}
        L.append("- optimizer step: " + (_unmeasured(ts) or (
            f"{_fs(ts.get('step_ms'), '{:.0f}')} ms, {_f(ts.get('tokens_per_s'), '{:,.0f}')} tokens/s, MFU "
            f"{_f(ts.get('mfu'), '{:.1%}')}, MFU vs GEMM {_f(ts.get('mfu_gemm'), '{:.1%}')}; measured peak "
            f"{_f(ts.get('peak_gib'))} GiB vs planned {_f(pl.get('total'))} GiB (`openrlhf-div plan-memory`, no "
            f"overhead: weights {_f(pl.get('weights'))}, grads {_f(pl.get('grads'))}, optimizer "
            f"{_f(pl.get('optimizer'))}, activations "
            f"{_f((pl.get('act_checkpoints') or 0) + (pl.get('act_layer') or 0))}, logits {_f(pl.get('logits'))})")))
        off = rows.get("offload", {})
        L += ["- offload / reload: " + (_unmeasured(off) or f"bit-exact {off.get('state_bit_exact')}, "
                                       f"{_f((off.get('freed_bytes') or 0) / 2**30)} GiB freed"), ""]
        plan_rows = [(rid, r) for rid, r in rows.items() if rid == "train_step" or rid.startswith("plan_")]
        if any(rid.startswith("plan_") for rid, _ in plan_rows):
            L += ["Planner (`openrlhf-div plan-memory`, no overhead) against the card:", "",
                  "| recompute | micro-batch | attention | measured peak GiB | planned GiB | planner error |",
                  "|---|---:|---|---:|---:|---:|"]
            for rid, r in plan_rows:
                why = _unmeasured(r)
                pl = r.get("plan_gib") or {}
                if why:
                    L.append(f"| {r.get('recompute', rid)} | {r.get('micro', '')} | | {why} | | |")
                    continue
                L.append(f"| {r.get('recompute', 'none')} | {r.get('micro', mg.get('micro'))} | "
                         f"{pl.get('attention', '-')} | {_f(r.get('peak_gib'))} | {_f(pl.get('total'))} | "
                         f"{_f(r.get('plan_error'), '{:+.1%}')} |")
            L.append("")
    lp = cases.get("logprobs")
    if lp:
        L += [f"**Log-probs + entropy at V = {lp.get('vocab', 0):,}, H = {lp.get('hidden')}** ({lp.get('dtype')} "
              f"inputs, TF32 {'on' if lp.get('tf32') else 'off'}; peak = above the inputs)", "",
              "| mode | tokens | path | ms | peak GiB |", "|---|---:|---|---|---|"]
        for rid, r in lp.get("rows", {}).items():
            mode, n, path = rid.split("/")
            L.append(f"| {mode} | {int(n):,} | {path} | {_unmeasured(r) or _fs(r.get('ms'), '{:.1f}')} | "
                     f"{'' if _unmeasured(r) else _fs(r.get('peak_above_inputs_gib'))} |")
        L.append("")
    dc = cases.get("decode")
    if dc:
        L += [f"**Lean decoder, token step per `decode_step`** ({dc.get('shape')}, bf16, {dc.get('n_rows')} rows; "
              f"{json.dumps(dc.get('setup'))}; step ms: the decoder's step alone, greedy tokens; generate: "
              "sampling end to end, temperature 1)", "",
              "| decode step | step ms | vs dynamic | generate s | gen tokens/s | samples vs | same rows | "
              "bit-exact | peak GiB |", "|---|---|---:|---|---:|---|---|---|---:|"]
        for name, r in dc.get("rows", {}).items():
            why = _unmeasured(r)
            if why:
                L.append(f"| {name} | {why} |" + " |" * 7)
                continue
            be = r.get("bit_exact")
            L.append(f"| {name} | {_fs(r.get('step_ms'), '{:.2f}')} | "
                     f"{_f(r.get('step_speedup_vs_dynamic'), '{:.2f}x')} | {_fs(r.get('generate_s'))} | "
                     f"{_f(med(r.get('gen_tokens_per_s')), '{:,.0f}')} | {r.get('vs', '-')} | "
                     f"{r.get('rows_same_tokens', '-')} | {'-' if be is None else ('yes' if be else 'no')} | "
                     f"{_f(r.get('peak_gib'))} |")
        L.append("")
    m = cases.get("methods")
    if m:
        L += [f"**Local engine, RL steps per method** ({m.get('shape')}, {_f((m.get('params') or 0) / 1e9)}B "
              f"parameters, bf16 + fp32 master weights; {json.dumps(m.get('setup'))})", "",
              "| method | step s | vs GRPO | train vs GRPO | generation s | old/ref log-probs s | fwd+bwd s | "
              "optimizer s | other s | gen tokens/s | MFU | MFU vs GEMM | peak GiB |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        rows = m.get("rows", {})
        base = med((rows.get("grpo") or {}).get("step_s"))
        base_train = med((rows.get("grpo") or {}).get("train_s"))
        for name, r in rows.items():
            why = _unmeasured(r)
            if why:
                L.append(f"| {name} | {why} |" + " |" * 11)
                continue
            st, tr = med(r.get("step_s")), med(r.get("train_s"))
            L.append(f"| {name} | {_fs(r.get('step_s'))} | {_f(st / base if base and st else None, '{:.2f}x')} | "
                     f"{_f(tr / base_train if base_train and tr else None, '{:.2f}x')} | "
                     f"{_f(med(r.get('generation_s')))} | {_f(med(r.get('logprobs_s')))} | "
                     f"{_f(med(r.get('fwd_bwd_s')))} | {_f(med(r.get('optimizer_s')))} | {_f(med(r.get('other_s')))} | "
                     f"{_f(med(r.get('gen_tokens_per_s')), '{:,.0f}')} | {_f(r.get('mfu'), '{:.1%}')} | "
                     f"{_f(r.get('mfu_gemm'), '{:.1%}')} | {_f(r.get('peak_gib'))} |")
        L.append("")
    lg = cases.get("largest")
    if lg:
        L += ["**Largest model that trains a local-engine GRPO step** (bf16 + fp32 master weights and AdamW "
              f"moments, after a warm-up step; largest first, gradient checkpointing only after an out-of-memory "
              f"error): **{lg.get('largest') or 'none of those tried'}**", "",
              "| shape | parameters | trains | gradient checkpointing | step s | peak GiB |",
              "|---|---:|---|---|---|---:|"]
        for name, r in lg.get("rows", {}).items():
            if "not_needed" in r:
                continue
            what = ("yes" if r.get("trains") else (_unmeasured(r) or "no"))
            gc_used = r.get("gradient_checkpointing")
            L.append(f"| {name} | {_f((r.get('params') or n_params(SHAPES[name])) / 1e9)}B | {what} | "
                     f"{'-' if gc_used is None else ('yes' if gc_used else 'no')} | "
                     f"{_fs(r.get('step_s'))} | {_f(r.get('peak_gib'))} |")
        L.append("")
    bad = {n: (c.get("ended") or c.get("error") or c.get("not_run") or "a row failed")
           for n, c in cases.items() if not c.get("ok")}
    if bad:
        L += ["Cases not ok: " + "; ".join(f"{n}: {str(v)[:200]}" for n, v in bad.items()), ""]
    L.append(END)
    return "\n".join(L) + "\n"


def write_docs(md: str, path: str = DOCS) -> None:
    """Replace the marked section of ``path`` with ``md`` (the rest of the file is kept)."""
    from openrlhf_div.io import atomic_write_text

    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + md.rstrip("\n") + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + md
    atomic_write_text(path, text)


def report(paths: List[str], docs: str = DOCS, measured: str = MEASURED) -> int:
    """``--report DIR...``: render the docs section from results folders (or their gpu_bench.json) and
    record the cases' measured wall times, which replace the guessed estimates from then on."""
    from openrlhf_div.io import atomic_write_json

    results = []
    for pth in paths:
        f = os.path.join(pth, "gpu_bench.json") if os.path.isdir(pth) else pth
        try:
            with open(f) as fh:
                results.append(json.load(fh))
        except (OSError, ValueError) as exc:
            print(f"[gpu_bench] --report {pth}: cannot read {f} ({exc}); give a folder a run wrote with --results",
                  file=sys.stderr)
            return 2
    if any(r.get("dry_run") for r in results):
        print("[gpu_bench] refusing to write a dry run's figures into the docs", file=sys.stderr)
        return 2
    write_docs(render(results), docs)
    walls: Dict[str, Any] = {}
    for r in results:
        for n, c in r.get("cases", {}).items():
            if c.get("wall_s") and not c.get("not_run"):
                walls[n] = {"wall_s": round(float(c["wall_s"]), 1), "ok": bool(c.get("ok"))}
    if walls:
        env = results[-1].get("environment", {})
        atomic_write_json(measured, {"device": env.get("device"), "date": env.get("date"), "cases": walls}, indent=1)
    print(f"[gpu_bench] wrote the gpu-bench section of {docs}" + (f" and the measured case times to {measured}"
                                                                  if walls else ""))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="cases (default order): " + ", ".join(CASES))
    p.add_argument("--dry-run", action="store_true", help="every case at toy size on the CPU (the rehearsal)")
    p.add_argument("--cases", default=None, help="comma-separated cases, run in this order (default: "
                                                 + ",".join(CASES) + ")")
    p.add_argument("--results", default=None, help="folder for gpu_bench.json / .md (+ gpu_bench.log from "
                                                    "gpu_bench.sh); default runs/gpu_bench (_dry with --dry-run)")
    p.add_argument("--docs", default=DOCS, help="(--report) the markdown file whose gpu-bench section is replaced")
    p.add_argument("--measured", default=MEASURED, help="(--report) where the measured case times go, which "
                                                         "replace the guessed estimates (default %(default)s)")
    p.add_argument("--peak-tflops", type=float, default=None, help="datasheet dense bf16 peak (default: 989 for "
                                                                   "H100 / H200)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"the whole run's seconds: a case starts only with half its estimate left, and is killed "
                        f"when the budget is spent (default {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--case-timeout-s", type=float, default=420.0, help="kill a case after this long (default 420)")
    p.add_argument("--record-imports", action="store_true", help="(device view) write imports_<case>.json")
    p.add_argument("--report", nargs="+", metavar="DIR", help="render the docs section from these results folders "
                                                               "(no case is run)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--case-out", help=argparse.SUPPRESS)
    p.add_argument("--gemm-tflops", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a.report:   # DeepSpeed's FusedAdam JIT build cannot parse '9.0a' (the image's value): the cases inherit it
        from openrlhf_div.compat.cuda_arch import fix_arch_env

        fix_arch_env(who="gpu_bench")
    if a.case:
        return run_case(a.case.split(","), a.dry_run, a.case_out, a.peak_tflops, a.gemm_tflops)
    if a.report:
        return report(a.report, a.docs, a.measured)
    a.results = a.results or os.path.join(ROOT, "runs", "gpu_bench_dry" if a.dry_run else "gpu_bench")
    a.argv_for_record = argv
    return drive(a)


if __name__ == "__main__":
    raise SystemExit(main())
