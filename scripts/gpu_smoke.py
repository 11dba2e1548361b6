"""GPU smoke run for a single-GPU machine without internet (``scripts/gpu_smoke.sh`` runs it).

What it runs, each case timed, all figures into one JSON (``--out``):

1. the local engine, 3 steps in bf16 on CUDA, for ``grpo`` and ``dph_js`` (D_pef pre-sampled on
   the spot), on the tiny Qwen2 and on a Qwen2.5-1.5B-shaped model (hidden 1536, 28 layers, 12
   heads / 2 KV heads, MLP 8960; random weights; the toy task's small vocabulary);
2. one OpenRLHF DeepSpeed ZeRO-2 actor step (OpenRLHF's ``DeepspeedStrategy`` with its real CUDA
   set-up: ``torch.cuda.set_device``, the "cuda" device mesh, NCCL, FusedAdam) through our
   ``DivActorPPOTrainer`` for ``grpo`` and ``dph_js`` (anchor rows), on the 1.5B-shaped model with
   Qwen2.5's vocabulary (151,936), random weights, synthetic rollouts. No Ray, no vLLM: the
   carried wheels cannot include Ray (~74 MB > 64 MiB), and this exercises the CUDA-only seams of
   docs/scaling.md that run without vLLM;
3. vLLM's ``PyNcclCommunicator`` weight broadcast only when vLLM is importable (it is not on the
   lent machine; the JSON says so).

Per case: ms/step, tokens/s, peak CUDA memory (GiB) and model FLOP utilisation
(``6 * params * tokens / time / peak_flops``; peak from ``--peak-tflops``, default 989 = H100
dense bf16). On CPU the module imports and :func:`plan` works (tests check that); :func:`main`
refuses to run without CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, rope_theta=1e6,
                  tie_word_embeddings=True)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True)


def plan(steps: int = 3) -> List[Dict[str, Any]]:
    """The cases, in order (pure; the tests call it on CPU)."""
    cases = []
    for shape in ("tiny", "qwen25_1.5b_shape"):
        for method in ("grpo", "dph_js"):
            cases.append({"kind": "local_engine", "shape": shape, "method": method, "steps": steps})
    for method in ("grpo", "dph_js"):
        cases.append({"kind": "openrlhf_actor_step", "shape": "qwen25_1.5b_shape", "method": method, "zero_stage": 2})
    cases.append({"kind": "pynccl_weight_broadcast", "needs": "vllm"})
    return cases


def n_params(cfg: Dict[str, Any]) -> int:
    """Parameters of a Qwen2 config (embeddings counted once when tied)."""
    h, i, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + heads * hd + 2 * kv * hd
    per_layer = attn + 3 * h * i + 2 * h
    emb = V * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return L * per_layer + emb + h


def mfu(params: int, tokens: float, seconds: float, peak_tflops: float) -> float:
    return 6.0 * params * tokens / max(seconds, 1e-9) / (peak_tflops * 1e12)


# ------------------------------------------------------------------ the cases (CUDA)
def _local_engine(case, work, peak):
    import torch

    from openrlhf_div.engines.local.config import load_config
    from openrlhf_div.engines.local.data import write_jsonl_atomic
    from openrlhf_div.engines.local.presample import presample
    from openrlhf_div.engines.local.toy import VOCAB, make_examples
    from openrlhf_div.engines.local.trainer import Trainer

    shape = TINY if case["shape"] == "tiny" else QWEN25_15B
    d = os.path.join(work, f"local_{case['shape']}_{case['method']}")
    os.makedirs(d, exist_ok=True)
    write_jsonl_atomic(os.path.join(d, "train.jsonl"), make_examples(256, seed=0))
    over = ["task=toy_copy", f"output_dir={d}/run", f"model.tiny_vocab={VOCAB}", "model.dtype=bfloat16",
            f"model.tiny_hidden_size={shape['hidden_size']}", f"model.tiny_layers={shape['num_hidden_layers']}",
            f"model.tiny_heads={shape['num_attention_heads']}", f"data.train={d}/train.jsonl", "device=cuda",
            "rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=32",
            "eval.at_start=false", "logging.tensorboard=false", "logging.progress=false", "checkpoint.every=0",
            f"method.name={case['method']}"]
    if case["method"] == "dph_js":
        over.append(f"data.presample_dir={d}/ps")
        presample(load_config(None, over))
    tr = Trainer(load_config(None, over))
    tr.train_step()  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0, tokens = time.perf_counter(), 0.0
    for _ in range(case["steps"]):
        row = tr.train_step()
        tokens += float(row.get("response_length", 0.0)) * 16 * 8
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    params = sum(p.numel() for p in tr.model.parameters())
    return {"ms_per_step": 1e3 * dt / case["steps"], "tokens_per_s": tokens / dt, "params": params,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "mfu_train_tokens": mfu(params, tokens, dt, peak)}


def _actor_step(case, work, peak):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_div.algorithms import get_method
    from openrlhf_div.compat import install_flash_attn_standin, install_vllm_stub

    install_flash_attn_standin()
    install_vllm_stub()  # vLLM is absent on the lent machine: import stub for openrlhf.trainer.ray
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from types import SimpleNamespace as NS

    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf_div.engines.openrlhf.actor import DivActorPPOTrainer
    from openrlhf_div.engines.openrlhf.logprob_actor import HiddenLogProbActor as Actor

    model_dir = os.path.join(work, "qwen25_15b_shape")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**QWEN25_15B, torch_dtype="bfloat16")).to(torch.bfloat16).save_pretrained(model_dir)
    method = get_method(case["method"])
    micro, batch, T, P = 4, 16, 1024, 256
    args = NS(
        ds=NS(param_dtype="bf16", zero_stage=case["zero_stage"], adam_offload=False, zpg=1, use_universal_ckpt=False,
              grad_accum_dtype=None, overlap_comm=False, deepcompile=False, tensor_parallel_size=1, ring_attn_size=1,
              packing_samples=False, attn_implementation="sdpa"),
        train=NS(dynamic_batch_enable=False, max_epochs=1, seed=0, colocate_all=False, async_enable=False,
                 micro_batch_size=micro, batch_size=batch, full_determinism_enable=False),
        actor=NS(eps_clip_low_high=(0.2, 0.2), dual_clip=None, loss_agg_mode="token-mean", policy_loss_type="ppo",
                 aux_loss_coef=0, entropy_coef=None, adam=NS(lr=1e-6)),
        algo=NS(advantage=NS(is_correction_level="off", is_correction_mode="mask", is_correction_gating="ratio",
                             is_correction_threshold=(0.5, 5.0)), kl=NS(use_loss=False)),
        vllm=NS(sync_backend="nccl"), local_rank=-1, div=NS(method=case["method"], anchor_data=None))
    strategy = DeepspeedStrategy(seed=0, micro_train_batch_size=micro, train_batch_size=batch,
                                 zero_stage=case["zero_stage"], args=args)
    strategy.setup_distributed()  # the real CUDA path: set_device, NCCL, "cuda" device mesh
    actor = Actor(model_dir, attn_implementation="sdpa", param_dtype="bf16", ds_config=strategy.get_ds_train_config())
    cfg = dict(optim="adam", adam=dict(lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
               lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.1, max_norm=1.0, scheduler_steps=100)
    actor, optim, sched = strategy.prepare((actor, cfg))
    trainer = DivActorPPOTrainer(strategy, actor, ema_model=None, actor_optim=optim, actor_scheduler=sched,
                                 micro_train_batch_size=micro, tokenizer=None, vllm_engines=None, method=method)
    exps = [_synthetic_experience(micro, T, P, QWEN25_15B["vocab_size"], method, i) for i in range(batch // micro)]
    for e in exps:
        trainer.replay_buffer.append(e)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    status = trainer.ppo_train(0.0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = float(batch * T)
    params = n_params(QWEN25_15B)
    return {"ms_per_step": 1e3 * dt, "tokens_per_s": tokens / dt, "params": params,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "mfu": mfu(params, tokens, dt, peak),
            "policy_loss": float(status.get("policy_loss", float("nan"))) if isinstance(status, dict) else None}


def _synthetic_experience(n, T, P, V, method, seed):
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience

    from openrlhf_div.engines.openrlhf.flags import ANCHOR_FLAG, CORRECT_FLAG

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(10, V, (n, T), generator=g).cuda()
    attn = torch.ones(n, T, dtype=torch.long, device="cuda")
    am = torch.zeros(n, T - 1, dtype=torch.bool, device="cuda")
    am[:, P - 1:] = True
    anchor = torch.zeros(n, device="cuda")
    if method.needs.anchor_batch and seed % 2 == 1:
        anchor[: n // 2] = 1.0  # half the rows of every other micro-batch are D_pef anchors
    lp = -2.0 * torch.ones(n, T - 1, device="cuda")
    adv = torch.randn(n, T - 1, generator=g).cuda() * am
    return Experience(sequences=seq, attention_mask=attn, action_mask=am, action_log_probs=lp,
                      base_action_log_probs=lp.clone(), advantages=adv, returns=adv.clone(),
                      rewards=torch.zeros(n, device="cuda"), scores=torch.zeros(n, device="cuda"),
                      response_length=torch.full((n,), float(T - P), device="cuda"),
                      truncated=torch.zeros(n, dtype=torch.bool, device="cuda"),
                      total_length=torch.full((n,), float(T), device="cuda"), index=list(range(n)),
                      prompts=[""] * n, labels=[""] * n, images=[None] * n, mm_train_inputs=[None] * n,
                      info={ANCHOR_FLAG: anchor, CORRECT_FLAG: torch.ones(n, device="cuda")})


def _pynccl(case, work, peak):
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vLLM is not installed on this machine: the PyNccl weight-sync seam stays unproven"}
    return {"skipped": "vLLM present but the broadcast needs a second process (run the e2e job on a GPU cluster)"}


RUNNERS = {"local_engine": _local_engine, "openrlhf_actor_step": _actor_step, "pynccl_weight_broadcast": _pynccl}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_smoke.json"))
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100: 989)")
    ap.add_argument("--only", default=None, help="comma-separated kinds to run")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device; nothing run", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "peak_tflops": a.peak_tflops, "cases": []}
    work = tempfile.mkdtemp(prefix="gpu_smoke_")
    for case in plan():
        if a.only and case["kind"] not in a.only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            res = RUNNERS[case["kind"]](case, work, a.peak_tflops)
            res["ok"] = "skipped" not in res
        except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others' figures
            import traceback

            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        res["wall_s"] = time.perf_counter() - t0
        out["cases"].append({**case, **res})
        print(json.dumps(out["cases"][-1])[:400], flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0 if all(c.get("ok") or "skipped" in c for c in out["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
