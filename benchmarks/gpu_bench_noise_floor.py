"""The bf16 log-prob noise floor on a CPU, at the GPU bench's real shape (issue 41, item 4).

    flock /tmp/openrlhf-div-heavy.lock .venv/bin/python benchmarks/gpu_bench_noise_floor.py [--shape qwen2.5-1.5b]

Qwen2.5-1.5B's config with the bench's random weights (seed 0, bf16), the bench's Megatron log-prob
batch (``plan(False)["megatron"]``: 2 rows of 512 tokens, prompt 256, the same token seed): log-probs
of the response tokens from the bf16 model against the same weights upcast to float32
(``gpu_bench.logprob_noise_floor``). Prints one JSON line; docs/benchmarks.md ("Log-prob noise
floor") holds the figure and ``gpu_bench.LOGPROB_TOL_BF16`` is set from it. A few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import gpu_bench as B

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(B.SHAPES))
    ap.add_argument("--rows", type=int, default=None, help="rows (default: the bench's lp_rows)")
    a = ap.parse_args(argv)
    p = B.plan(False)["megatron"]
    rows = a.rows or p["lp_rows"]
    shape = B.SHAPES[a.shape]
    torch.manual_seed(0)   # the bench's weights (case_megatron)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, pad_token_id=0, eos_token_id=1)).to(torch.bfloat16).eval()
    gg = torch.Generator().manual_seed(0)   # the bench's batch(lp_rows, lp_seq, 0)
    seq = torch.randint(2, shape["vocab_size"], (rows, p["lp_seq"]), generator=gg)
    am = torch.ones_like(seq)
    act = torch.zeros(rows, p["lp_seq"] - 1)
    act[:, p["prompt"] - 1:] = 1
    t0 = time.time()
    out = B.logprob_noise_floor(model, seq, am, act)
    out.update(shape=a.shape, rows=rows, seq=p["lp_seq"], prompt=p["prompt"], device="cpu",
               torch=torch.__version__, seconds=round(time.time() - t0, 1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
