"""Megatron actor on a GPU (skipped without CUDA): a tiny Qwen2 built both as a Hugging Face model
and as the Megatron engine at TP=1 (bf16, Transformer Engine spec when installed) gives matching
log-probs within bf16 tolerance, exports the loaded weights unchanged, and one training step runs.

Run: ``pytest tests/gpu/test_megatron_gpu.py -s`` (``-s`` prints step time and peak memory).
"""
import os
import socket
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")

from openrlhf_div.algorithms import get_method  # noqa: E402
from openrlhf_div.engines.megatron.config import MegatronConfig  # noqa: E402
from openrlhf_div.engines.megatron.loss import MicroBatch  # noqa: E402

pytestmark = pytest.mark.gpu
V, TEMP = 1024, 1.0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_div.engines.megatron.engine import init_megatron_parallel

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    mcfg = MegatronConfig(tp=1, pp=1, bf16=True, distributed_optimizer=True)
    init_megatron_parallel(mcfg, seed=1)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                      max_position_embeddings=512, torch_dtype="bfloat16")
    hf = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    hf.save_pretrained(path)
    return mcfg, path, hf.cuda().eval()


def _batch(B=4, L=64):
    """Token ids, attention mask (one row ends in padding) and response mask (from position 32)."""
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, V, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    am[1, L - 9:] = 0
    act = torch.zeros(B, L - 1)
    act[:, 32:] = 1
    act[1, L - 10:] = 0
    return seq, am, act


def test_logprobs_match_hf_bf16(setup):
    from openrlhf_div.engines.megatron.engine import MegatronEngine

    mcfg, path, hf = setup
    eng = MegatronEngine(mcfg, pretrain=path, train=False, temperature=TEMP)
    seq, am, act = _batch()
    lp, h = eng.forward_log_probs(seq, am, act, need_entropy=True)
    with torch.no_grad():
        logits = hf(seq.cuda(), attention_mask=am.cuda(),
                    position_ids=(am.cumsum(-1) - 1).clamp(min=0).cuda()).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / TEMP, -1)
    ref = (logp.gather(-1, seq[:, 1:, None].cuda())[..., 0]).cpu() * act
    ref_h = (-(logp.exp() * logp).sum(-1)).cpu() * act
    diff = (lp - ref).abs()[act.bool()]
    # the noise floor: the same HF weights in float32 on the same tokens; two bf16 implementations each
    # within the floor of the float32 answer differ by at most twice it (benchmarks/gpu_bench.py,
    # LOGPROB_TOL_FACTOR; docs/benchmarks.md, "GPU figures" item 4)
    import copy

    from openrlhf_div.algorithms._utils import masked_agreement

    with torch.no_grad():
        hi = copy.deepcopy(hf).float()(seq.cuda(), attention_mask=am.cuda(),
                                       position_ids=(am.cumsum(-1) - 1).clamp(min=0).cuda()).logits.float()
    ref_hi = torch.log_softmax(hi[:, :-1] / TEMP, -1).gather(-1, seq[:, 1:, None].cuda())[..., 0].cpu() * act
    floor = masked_agreement(ref, ref_hi, act, "HF bf16 vs float32 log-probs")
    print(f"\n[megatron-gpu] weights via {eng.weights_path}; log-prob |diff| mean {diff.mean():.2e} max {diff.max():.2e}; "
          f"noise floor mean {floor['mean_abs']:.2e} max {floor['max_abs']:.2e}; "
          f"entropy |diff| max {(h - ref_h).abs().max():.2e}")
    assert diff.max() <= 2 * floor["max_abs"] and diff.mean() <= 2 * floor["mean_abs"], (diff.max(), floor)
    assert (h - ref_h).abs().max() < 2e-1
    exported = eng.hf_state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(exported[k].cpu(), v.cpu()), k


def test_one_training_step(setup):
    from openrlhf_div.engines.megatron.engine import MegatronEngine, OptimSettings

    mcfg, path, _ = setup
    eng = MegatronEngine(mcfg, pretrain=path, train=True, method=get_method("dph_js"), temperature=TEMP,
                         optim=OptimSettings(lr=1e-5, warmup_ratio=0.0, lr_scheduler="constant", max_steps=10))
    seq, am, act = _batch(B=8, L=128)
    old, _ = eng.forward_log_probs(seq, am, act)
    g = torch.Generator().manual_seed(1)
    mb = MicroBatch(sequences=seq, attention_mask=am, action_mask=act, old_log_probs=old,
                    advantages=torch.randn(8, generator=g)[:, None] * act,
                    is_anchor=torch.tensor([False] * 6 + [True] * 2), anchor_ref_log_probs=old - 0.1 * act)
    before = {k: v.float().clone() for k, v in eng.hf_state_dict().items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        t = time.time()
        m = eng.train_step([mb, mb])
        torch.cuda.synchronize()
        times.append(time.time() - t)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    print(f"\n[megatron-gpu] train_step (2 micro-batches of 8 x 128): {min(times) * 1e3:.1f} ms, peak {peak:.2f} GiB, "
          f"metrics {m}")
    assert m["update_successful"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    after = eng.hf_state_dict()
    assert any(not torch.equal(before[k], after[k].float()) for k in before)
