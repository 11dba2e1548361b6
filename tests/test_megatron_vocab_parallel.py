"""Vocabulary-parallel log-probs and entropy from hidden states (TP=2, gloo) equal the unsharded
computation: values and the gradients of the hidden states and of every weight row."""
import pytest
import torch

from openrlhf_div.compat.mcore_cpu import run_multiprocess
from openrlhf_div.algorithms import log_probs_from_hidden
from openrlhf_div.engines.megatron.vocab_parallel import (
    output_layer_returns_hidden,
    output_weight,
    vocab_parallel_log_probs_from_hidden,
    vocab_range,
)

# (batch, seq, hidden, padded vocab, valid vocab, temperature, dtype, chunk)
CASES = [
    (2, 5, 8, 16, 16, 1.0, torch.float32, None),
    (3, 4, 6, 20, 17, 0.7, torch.float32, 5),    # Megatron vocab padding: 3 padded rows on rank 1
    (2, 3, 4, 12, 5, 1.3, torch.float32, 2),     # rank 1's whole slice is padding
    (2, 6, 8, 32, 30, 1.0, torch.bfloat16, 4),
]


def _inputs(case, seed):
    b, t, hd, vp, v, temp, dtype, chunk = case
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(b, t, hd, generator=g) * 2).to(dtype)
    weight = torch.randn(vp, hd, generator=g).to(dtype)
    target = torch.randint(0, v, (b, t), generator=g)
    w_lp = torch.randn(b, t, generator=g)
    w_h = torch.randn(b, t, generator=g)
    return hidden, weight, target, w_lp, w_h


def _reference(hidden, weight, target, v, temp, w_lp, w_h):
    """Unsharded full logits over the valid vocabulary, log_softmax, autograd gradients."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    z = (h @ w[:v].t()).float() / temp
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((w_lp * lp).sum() + (w_h * ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad.float(), w.grad.float()


def _worker(rank, world, cases):
    import torch.distributed as dist
    outs = []
    for i, case in enumerate(cases):
        b, t, hd, vp, v, temp, dtype, chunk = case
        hidden, weight, target, w_lp, w_h = _inputs(case, seed=i)
        start, end = vocab_range(vp, rank, world)
        h = hidden.clone().requires_grad_(True)
        shard = weight[start:end].clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs_from_hidden(h, shard, target, vocab_start=start, vocab_size=v,
                                                       temperature=temp, group=dist.group.WORLD, chunk_size=chunk)
        ((w_lp * lp).sum() + (w_h * ent).sum()).backward()
        lp_only, none = vocab_parallel_log_probs_from_hidden(hidden, weight[start:end], target, vocab_start=start,
                                                             vocab_size=v, temperature=temp, group=dist.group.WORLD,
                                                             need_entropy=False, chunk_size=chunk)
        assert none is None
        outs.append(dict(lp=lp.detach(), h=ent.detach(), grad_h=h.grad.float(), grad_w=shard.grad.float(),
                         lp_only=lp_only))
    return outs


@pytest.fixture(scope="module")
def tp2_results():
    return run_multiprocess(_worker, world_size=2, args=(CASES,), timeout=60)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_tp2_values_and_grads_equal_unsharded(tp2_results, i):
    case = CASES[i]
    b, t, hd, vp, v, temp, dtype, chunk = case
    hidden, weight, target, w_lp, w_h = _inputs(case, seed=i)
    lp_ref, h_ref, gh_ref, gw_ref = _reference(hidden, weight, target, v, temp, w_lp, w_h)
    tol = dict(rtol=0, atol=1e-5)
    for res in tp2_results:
        r = res[i]
        torch.testing.assert_close(r["lp"], lp_ref, **tol)
        torch.testing.assert_close(r["h"], h_ref, **tol)
        torch.testing.assert_close(r["lp_only"], lp_ref, **tol)
    # bf16 gradients are rounded on the way out
    gtol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=0, atol=1e-5)
    for res in tp2_results:  # the hidden-state gradient is all-reduced: every rank holds the full one
        torch.testing.assert_close(res[i]["grad_h"], gh_ref, **gtol)
    grad_w = torch.cat([res[i]["grad_w"] for res in tp2_results], dim=0)
    torch.testing.assert_close(grad_w[:v], gw_ref[:v], **gtol)
    assert torch.all(grad_w[v:] == 0), "padded vocabulary rows must get zero gradient"


def test_tp1_is_log_probs_from_hidden():
    hidden, weight, target, w_lp, w_h = _inputs(CASES[1], seed=9)
    a = vocab_parallel_log_probs_from_hidden(hidden, weight, target, vocab_size=17, temperature=0.7)
    lp_ref, h_ref, _, _ = _reference(hidden, weight, target, 17, 0.7, w_lp, w_h)
    torch.testing.assert_close(a[0], lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(a[1], h_ref, rtol=0, atol=1e-5)
    b = log_probs_from_hidden(hidden, weight[:17], target, temperature=0.7, return_entropy=True)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)


def test_gradcheck_double():
    torch.manual_seed(1)
    h = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 6, (2, 3))
    # fp32 inside, so a loose gradcheck; exact agreement is tested above
    f = lambda a, b: sum(vocab_parallel_log_probs_from_hidden(a, b, target, temperature=0.9, chunk_size=2))  # noqa: E731
    assert torch.autograd.gradcheck(f, (h, w), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_log_probs_from_hidden(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_parallel_log_probs_from_hidden(torch.zeros(2, 4), torch.zeros(5, 4), torch.full((2,), 7), vocab_size=5)
    with pytest.raises(ValueError, match="divisible"):
        vocab_range(10, 0, 4)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 4))
        self.bias = None
        self.sequence_parallel = False

    def forward(self, x, weight=None, runtime_gather_output=None):
        return x @ (self.weight if weight is None else weight).t(), None


class _GPT(torch.nn.Module):
    """The two lines of GPTModel's forward that matter here: output layer, then [s b] -> [b s]."""

    post_process = True
    share_embeddings_and_output_weights = False

    def __init__(self):
        super().__init__()
        self.output_layer = _Layer()

    def forward(self, x):
        out, _ = self.output_layer(x)
        return out.transpose(0, 1)


def test_output_layer_returns_hidden_swaps_and_restores():
    gpt = _GPT()
    x = torch.randn(5, 2, 4)  # [s, b, h]
    assert gpt(x).shape == (2, 5, 6)
    with output_layer_returns_hidden(gpt) as has_head:
        assert has_head
        torch.testing.assert_close(gpt(x), x.transpose(0, 1))
    assert gpt(x).shape == (2, 5, 6) and "forward" not in gpt.output_layer.__dict__
    assert output_weight(gpt) is gpt.output_layer.weight
    gpt.post_process = False
    with output_layer_returns_hidden(gpt) as has_head:
        assert not has_head
