"""Vocabulary-parallel log-probs and entropy (TP=2, gloo) equal the unsharded computation."""
import pytest
import torch

from mcore_cpu import run_multiprocess
from openrlhf_div.engines.megatron.vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_entropy,
    vocab_range,
)

# (batch, seq, padded vocab, valid vocab, temperature, logits dtype)
CASES = [
    (2, 5, 16, 16, 1.0, torch.float32),
    (3, 4, 20, 17, 0.7, torch.float32),   # Megatron vocab padding: 3 padded entries on rank 1
    (2, 3, 12, 5, 1.3, torch.float32),    # rank 1's whole slice is padding
    (2, 6, 32, 30, 1.0, torch.bfloat16),
]


def _inputs(case, seed):
    b, t, vp, v, temp, dtype = case
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, vp, generator=g) * 3).to(dtype)
    target = torch.randint(0, v, (b, t), generator=g)
    w_lp = torch.randn(b, t, generator=g)
    w_h = torch.randn(b, t, generator=g)
    return logits, target, w_lp, w_h


def _reference(logits, target, v, temp, w_lp, w_h):
    """Unsharded: log_softmax over the valid vocabulary, autograd gradient."""
    full = logits.detach().float().requires_grad_(True)
    z = full[..., :v] / temp
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    h = -(logp.exp() * logp).sum(-1)
    ((w_lp * lp).sum() + (w_h * h).sum()).backward()
    return lp.detach(), h.detach(), full.grad


def _worker(rank, world, cases):
    import torch.distributed as dist
    outs = []
    for i, case in enumerate(cases):
        b, t, vp, v, temp, dtype = case
        logits, target, w_lp, w_h = _inputs(case, seed=i)
        start, end = vocab_range(vp, rank, world)
        shard = logits[..., start:end].clone().requires_grad_(True)
        lp, h = vocab_parallel_log_probs_entropy(shard, target, vocab_start=start, vocab_size=v,
                                                 temperature=temp, group=dist.group.WORLD)
        ((w_lp * lp).sum() + (w_h * h).sum()).backward()
        # the single-output variants must agree with the fused one
        lp_only = vocab_parallel_log_probs(shard.detach(), target, vocab_start=start, vocab_size=v,
                                           temperature=temp, group=dist.group.WORLD)
        h_only = vocab_parallel_entropy(shard.detach(), vocab_start=start, vocab_size=v, temperature=temp,
                                        group=dist.group.WORLD)
        outs.append(dict(lp=lp.detach(), h=h.detach(), grad=shard.grad.float(), lp_only=lp_only,
                         h_only=h_only))
    return outs


@pytest.fixture(scope="module")
def tp2_results():
    return run_multiprocess(_worker, world_size=2, args=(CASES,), timeout=60)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_tp2_values_and_grads_equal_unsharded(tp2_results, i):
    case = CASES[i]
    b, t, vp, v, temp, dtype = case
    logits, target, w_lp, w_h = _inputs(case, seed=i)
    lp_ref, h_ref, grad_ref = _reference(logits, target, v, temp, w_lp, w_h)
    tol = dict(rtol=1e-5, atol=1e-5)
    for rank, res in enumerate(tp2_results):
        r = res[i]
        torch.testing.assert_close(r["lp"], lp_ref, **tol)
        torch.testing.assert_close(r["h"], h_ref, **tol)
        torch.testing.assert_close(r["lp_only"], lp_ref, **tol)
        torch.testing.assert_close(r["h_only"], h_ref, **tol)
    grad = torch.cat([res[i]["grad"] for res in tp2_results], dim=-1)
    # bf16 gradients are rounded on the way out
    gtol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad[..., :v], grad_ref[..., :v], **gtol)
    assert torch.all(grad[..., v:] == 0), "padded vocabulary entries must get zero gradient"


def test_single_process_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)
    target = torch.randint(0, 11, (3, 7))
    lp, h = vocab_parallel_log_probs_entropy(logits, target)
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, logp.gather(-1, target[..., None])[..., 0])
    torch.testing.assert_close(h, -(logp.exp() * logp).sum(-1))
    (lp.sum() - 0.5 * h.sum()).backward()
    ref = logits.detach().clone().requires_grad_(True)
    lr = torch.log_softmax(ref, -1)
    (lr.gather(-1, target[..., None]).sum() + 0.5 * (lr.exp() * lr).sum()).backward()
    torch.testing.assert_close(logits.grad, ref.grad)


def test_gradcheck_double():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 6, (2, 3))
    # fp32 inside, so a loose gradcheck; exact agreement is tested above
    f = lambda x: sum(vocab_parallel_log_probs_entropy(x, target, temperature=0.9))  # noqa: E731
    assert torch.autograd.gradcheck(f, (logits,), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_log_probs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        vocab_range(10, 0, 4)
