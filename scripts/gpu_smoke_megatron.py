"""GPU smoke test of the Megatron actor (the Megatron part of ``scripts/gpu_smoke.sh``).

    python scripts/gpu_smoke_megatron.py [--out megatron_smoke.json] [--hidden 256 --layers 4]

One process, one GPU, TP=1, bf16, megatron-core from the installed wheel (Transformer Engine's
layer spec when TE is importable, else megatron-core's local spec). On a tiny Qwen2 saved as a
Hugging Face checkpoint it checks, and writes as JSON:

1. ``logprobs_step0``: the engine's old log-probs equal the HF model's (bf16 tolerance);
2. ``train_step``: one Adam step through Megatron's schedule and the registry loss; the
   weights it exports, loaded into the HF model, give the engine's log-probs again;
3. ``offload``: ``offload()`` frees the optimizer state and gradient buffers (bytes measured
   with ``torch.cuda.memory_allocated``), the forward while offloaded is bit-exact, and after
   ``reload()`` every optimizer-state tensor is bit-exact;
4. ``bytes_per_param``: GPU bytes per parameter after a step with the optimizer on the GPU, with
   the precision-aware host optimizer (``--megatron.optimizer_cpu_offload``, the configs' 1-node
   setting) and with the host optimizer without ``use_precision_aware_optimizer`` (the earlier
   setting; megatron-core then keeps fp32 main params on the GPU). The host-optimizer rows need
   transformer_engine (megatron-core checks its version) and are marked skipped without it.

Exit status 0 when every check passed, 1 when one failed, 2 without CUDA (nothing run). Status:
written without a GPU; **it has not run yet**.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny(path: str, hidden: int, layers: int, vocab: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      tie_word_embeddings=False, max_position_embeddings=1024, torch_dtype="bfloat16")
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return model.cuda().eval()


def _batch(vocab: int, B: int = 4, L: int = 96):
    import torch

    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, vocab, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    am[1, L - 9:] = 0
    act = torch.zeros(B, L - 1)
    act[:, 32:] = 1
    act[1, L - 10:] = 0
    return seq, am, act


def _hf_log_probs(model, seq, am, act, temperature=1.0):
    import torch

    with torch.no_grad():
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        logits = model(seq.cuda(), attention_mask=am.cuda(), position_ids=pos.cuda()).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, seq.cuda()[:, 1:, None])[..., 0]
    return (lp * act.cuda()).cpu()


def _engine(path: str, optimizer_cpu_offload: bool = False):
    from openrlhf_div.algorithms import get_method
    from openrlhf_div.engines.megatron.config import MegatronConfig
    from openrlhf_div.engines.megatron.engine import MegatronEngine, OptimSettings

    mcfg = MegatronConfig(tp=1, pp=1, bf16=True, distributed_optimizer=True, optimizer_cpu_offload=optimizer_cpu_offload)
    optim = OptimSettings(optimizer="adam", lr=1e-4, lr_scheduler="constant", warmup_ratio=0.0, max_steps=10)
    return MegatronEngine(mcfg, pretrain=path, train=True, optim=optim, method=get_method("grpo"))


def _step(engine, seq, am, act):
    import torch

    from openrlhf_div.engines.megatron.loss import MicroBatch

    lp, _ = engine.forward_log_probs(seq, am, act)
    adv = torch.linspace(-1, 1, seq.shape[0])[:, None] * act
    return engine.train_step([MicroBatch(sequences=seq, attention_mask=am, action_mask=act, old_log_probs=lp,
                                         advantages=adv)])


def _optimizer_state(engine):
    from openrlhf_div.engines.megatron.offload import training_state_tensors

    keep, _, _ = training_state_tensors(engine.model, engine.optimizer)
    return [t.detach().clone() for t in keep]


def bytes_per_param(path: str, seq, am, act, mode: str) -> Dict[str, Any]:
    """GPU bytes per parameter after one step: ``gpu`` (Adam on the GPU), ``host`` (precision-aware
    host optimizer), ``host_legacy`` (host optimizer without use_precision_aware_optimizer)."""
    import gc

    import torch

    from openrlhf_div.engines.megatron import engine as E

    if mode != "gpu":
        from megatron.core.utils import get_te_version

        if get_te_version() is None:
            return {"skipped": "needs transformer_engine (megatron-core checks its version)"}
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    saved = E.optimizer_config
    eng = None
    if mode == "host_legacy":
        def legacy(mcfg, o):
            cfg = saved(mcfg, o)
            cfg.use_precision_aware_optimizer = False
            cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = False
            return cfg
        E.optimizer_config = legacy
    try:
        eng = _engine(path, optimizer_cpu_offload=mode != "gpu")
        _step(eng, seq, am, act)
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated() - base
        n = sum(p.numel() for p in eng.gpt.parameters())
        out = {"params": n, "gpu_bytes": used, "bytes_per_param": used / n}
    finally:
        E.optimizer_config = saved
        eng = None
        gc.collect()
        torch.cuda.empty_cache()
    return out


def run(args) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    import megatron.core

    from openrlhf_div.engines.megatron.config import MegatronConfig
    from openrlhf_div.engines.megatron.engine import init_megatron_parallel
    from openrlhf_div.engines.megatron.model import use_transformer_engine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    init_megatron_parallel(MegatronConfig(tp=1, pp=1), seed=1)
    res: Dict[str, Any] = {"device": torch.cuda.get_device_name(0), "megatron_core": megatron.core.__version__,
                           "transformer_engine_spec": use_transformer_engine(MegatronConfig()), "checks": {}}
    checks = res["checks"]
    tol = dict(rtol=0, atol=args.atol)
    with tempfile.TemporaryDirectory() as tmp:
        hf = _tiny(tmp, args.hidden, args.layers, args.vocab)
        seq, am, act = _batch(args.vocab)
        eng = _engine(tmp)
        lp0, _ = eng.forward_log_probs(seq, am, act)
        ref0 = _hf_log_probs(hf, seq, am, act)
        err0 = float((lp0 - ref0).abs().max())
        checks["logprobs_step0"] = {"max_abs_diff": err0, "ok": err0 <= tol["atol"]}

        t0 = time.time()
        metrics = _step(eng, seq, am, act)
        torch.cuda.synchronize()
        lp1, _ = eng.forward_log_probs(seq, am, act)
        hf.load_state_dict({k: v.to(torch.bfloat16) for k, v in eng.hf_state_dict().items()}, strict=True)
        err1 = float((lp1 - _hf_log_probs(hf, seq, am, act)).abs().max())
        moved = float((lp1 - lp0).abs().max())
        checks["train_step"] = {"seconds": time.time() - t0, "loss": metrics.get("loss"),
                                "grad_norm": metrics.get("actor_grad_norm"), "logprob_change": moved,
                                "exported_vs_engine_max_abs_diff": err1, "ok": err1 <= tol["atol"] and moved > 0}

        state_before = _optimizer_state(eng)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        freed = eng.offload()
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        lp_off, _ = eng.forward_log_probs(seq, am, act)
        eng.reload()
        state_after = _optimizer_state(eng)
        exact = len(state_before) == len(state_after) and all(
            torch.equal(a, b) for a, b in zip(state_before, state_after))
        checks["offload"] = {"freed_bytes": freed, "allocated_drop": before - after,
                             "forward_while_offloaded_bit_exact": bool(torch.equal(lp_off, lp1)),
                             "optimizer_state_bit_exact": exact,
                             "ok": freed > 0 and before - after >= freed * 0.9 and exact and torch.equal(lp_off, lp1)}
        del eng, state_before, state_after
        res["bytes_per_param"] = {m: bytes_per_param(tmp, seq, am, act, m) for m in ("gpu", "host", "host_legacy")}
    dist.destroy_process_group()
    res["ok"] = all(c["ok"] for c in checks.values())
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--atol", type=float, default=0.05, help="bf16 tolerance on log-probs")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke_megatron: needs CUDA; nothing run", file=sys.stderr)
        return 2
    res = run(args)
    text = json.dumps(res, indent=2, default=float)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
