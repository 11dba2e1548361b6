"""Step time and peak memory: the Megatron engine vs a DeepSpeed (ZeRO-2) actor, same tiny model.

Both sides train the same Qwen2 (built from a config, bf16 on GPU / fp32 on CPU) on the same
micro-batches with the same registry loss (``--method``, default ``dph_js``); the DeepSpeed side
is a Hugging Face model under ``deepspeed.initialize`` with OpenRLHF's log-prob computation
(full-vocabulary log-softmax), the Megatron side :class:`MegatronEngine` at TP=1.

    python examples/scripts/megatron/bench_actor_step.py --steps 10 [--hidden 1024 --layers 8]

Prints one JSON line per backend (ms per optimiser step, median of ``--steps`` after one warm-up
step; peak allocated GiB on CUDA). On CPU it only checks that both paths run (timings are
meaningless there). Single process; ``torch.distributed`` is initialised on a free local port.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batches(args, vocab):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.micro_batches):
        seq = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=g)
        am = torch.ones_like(seq)
        act = torch.zeros(args.micro_batch, args.seq_len - 1)
        act[:, args.seq_len // 4:] = 1
        out.append(dict(sequences=seq, attention_mask=am, action_mask=act,
                        old_log_probs=-torch.rand(args.micro_batch, args.seq_len - 1, generator=g) * act,
                        advantages=torch.randn(args.micro_batch, 1, generator=g) * act))
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, steps):
    fn()  # warm-up
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    ts = []
    for _ in range(steps):
        t = time.time()
        fn()
        sync()
        ts.append(time.time() - t)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else float("nan")
    return statistics.median(ts) * 1e3, peak


def bench_megatron(args, cfg, path, method):
    from openrlhf_div.engines.megatron.config import MegatronConfig
    from openrlhf_div.engines.megatron.engine import MegatronEngine, OptimSettings, init_megatron_parallel
    from openrlhf_div.engines.megatron.loss import MicroBatch

    cuda = torch.cuda.is_available()
    mcfg = MegatronConfig(tp=1, bf16=cuda, distributed_optimizer=True,
                          recompute="full" if args.recompute else "none")
    init_megatron_parallel(mcfg)
    eng = MegatronEngine(mcfg, pretrain=path, train=True, method=method,
                         optim=OptimSettings(lr=1e-6, warmup_ratio=0.0, lr_scheduler="constant", max_steps=1000))
    mbs = [MicroBatch(**b) for b in batches(args, cfg.vocab_size)]
    return timed(lambda: eng.train_step(mbs), args.steps)


def bench_deepspeed(args, cfg, path, method):
    import deepspeed
    from transformers import AutoModelForCausalLM

    from openrlhf_div.algorithms.registry import LossInputs

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if cuda else torch.float32)
    if args.recompute:
        model.gradient_checkpointing_enable()
    ds_cfg = {"train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": args.micro_batches, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": cuda},
              "optimizer": {"type": "AdamW" if cuda else "Adam", "params": {"lr": 1e-6, "betas": [0.9, 0.95]}}}
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    dev = eng.device
    bs = batches(args, cfg.vocab_size)
    n_tok = sum(float(b["action_mask"].sum()) for b in bs)

    def step():
        for b in bs:
            b = {k: v.to(dev) for k, v in b.items()}
            logits = eng(b["sequences"], attention_mask=b["attention_mask"]).logits.float()[:, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, b["sequences"][:, 1:, None])[..., 0]
            online = LossInputs(log_probs=lp, old_log_probs=b["old_log_probs"], advantages=b["advantages"],
                                mask=b["action_mask"])
            loss, _ = method.loss(online=online, num_online_tokens=n_tok)
            eng.backward(loss * args.micro_batches)   # DeepSpeed divides by gradient_accumulation_steps
            eng.step()
    return timed(step, args.steps)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["megatron", "deepspeed", "both"], default="both")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--micro_batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--method", default="grpo")
    args = p.parse_args()

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_div.algorithms import get_method

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    heads = max(args.hidden // 64, 2)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75) // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                      max_position_embeddings=max(args.seq_len, 512), tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="bench_qwen2_")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    method = get_method(args.method)
    for name in (["megatron", "deepspeed"] if args.backend == "both" else [args.backend]):
        fn = bench_megatron if name == "megatron" else bench_deepspeed
        ms, peak = fn(args, cfg, path, method)
        print(json.dumps({"backend": name, "device": "cuda" if torch.cuda.is_available() else "cpu",
                          "ms_per_step": round(ms, 2), "peak_gib": round(peak, 3), "hidden": args.hidden,
                          "layers": args.layers, "seq_len": args.seq_len,
                          "tokens_per_step": args.micro_batch * args.micro_batches * args.seq_len}), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
