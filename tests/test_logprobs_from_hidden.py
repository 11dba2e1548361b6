"""log_probs_from_hidden against the full-logits computation: values and gradients (float32, 1e-5)."""
import pytest
import torch

from openrlhf_div.algorithms import get_method, log_probs_from_hidden
from openrlhf_div.algorithms.registry import AnchorInputs, LossInputs

ATOL = 1e-5


def _full(hidden, weight, targets, bias=None, temperature=1.0):
    """The old path: full [N, V] float32 logits, log_softmax, gather, entropy from exp()."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _inputs(B=3, T=7, H=16, V=50, seed=0, dtype=torch.float32, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g) * 2).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype).requires_grad_(True) if bias else None
    y = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    return h, w, b, y, mask


def _grads(loss, *ts):
    return torch.autograd.grad(loss, [t for t in ts if t is not None])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk", [1, 4, 5, None])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_match_full_logits(temperature, chunk, bias):
    h, w, b, y, mask = _inputs(bias=bias)
    g = torch.Generator().manual_seed(1)
    c_lp, c_h = torch.randn(y.shape, generator=g), torch.randn(y.shape, generator=g)
    lp0, ent0 = _full(h, w, y, b, temperature)
    lp1, ent1 = log_probs_from_hidden(h, w, y, bias=b, temperature=temperature, return_entropy=True, chunk_size=chunk)
    assert lp1.dtype == torch.float32 and ent1.dtype == torch.float32 and lp1.shape == y.shape
    torch.testing.assert_close(lp1, lp0, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=ATOL, rtol=0)
    # masked tokens: a loss over log-probs and entropy, zero weight where the mask is 0
    l0 = ((c_lp * lp0 + c_h * ent0) * mask).sum()
    l1 = ((c_lp * lp1 + c_h * ent1) * mask).sum()
    for a, e in zip(_grads(l1, h, w, b), _grads(l0, h, w, b)):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)


def test_log_probs_only_and_entropy_only_gradients():
    h, w, _, y, mask = _inputs(seed=3)
    lp0, ent0 = _full(h, w, y, temperature=0.8)
    lp1, none = log_probs_from_hidden(h, w, y, temperature=0.8, chunk_size=3)
    assert none is None
    for a, e in zip(_grads((lp1 * mask).sum(), h, w), _grads((lp0 * mask).sum(), h, w)):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)
    _, ent1 = log_probs_from_hidden(h, w, y, temperature=0.8, chunk_size=3, return_entropy=True)
    _, ent0 = _full(h, w, y, temperature=0.8)
    for a, e in zip(_grads((ent1 * mask).sum(), h, w), _grads((ent0 * mask).sum(), h, w)):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)


def test_registry_loss_with_anchor_rows_matches_full_logits():
    """A DPH method's loss over online and anchor rows: same loss and gradients as full logits."""
    method = get_method("dph_js", anchor_eta=0.1)
    h, w, _, y, mask = _inputs(B=4, T=6, seed=5)
    g = torch.Generator().manual_seed(6)
    anchor = torch.tensor([False, True, False, True])
    old = torch.randn(y.shape, generator=g) * 0.1 - 3
    adv = torch.randn(y.shape, generator=g)
    ref = torch.randn(y.shape, generator=g) * 0.1 - 3

    def loss_of(lp, ent):
        on = LossInputs(log_probs=lp[~anchor], old_log_probs=old[~anchor] + lp[~anchor].detach(),
                        advantages=adv[~anchor], mask=mask[~anchor], correct=torch.tensor([True, False]),
                        entropy=ent[~anchor])
        an = AnchorInputs(log_probs=lp[anchor], ref_log_probs=ref[anchor], mask=mask[anchor])
        return method.loss(online=on, anchor=an, num_online_tokens=float(mask[~anchor].sum()),
                           num_anchor_tokens=float(mask[anchor].sum()), num_online_seqs=2.0)[0]

    l0 = loss_of(*_full(h, w, y, temperature=0.9))
    l1 = loss_of(*log_probs_from_hidden(h, w, y, temperature=0.9, return_entropy=True, chunk_size=5))
    torch.testing.assert_close(l1, l0, atol=ATOL, rtol=0)
    for a, e in zip(_grads(l1, h, w), _grads(l0, h, w)):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)


def test_low_precision_input_accumulates_in_float32():
    h, w, _, y, _ = _inputs(seed=7, dtype=torch.bfloat16)
    lp0, ent0 = _full(h, w, y)  # bf16 linear, then float32: what an HF model + .float() does
    lp1, ent1 = log_probs_from_hidden(h, w, y, return_entropy=True, chunk_size=4)
    assert lp1.dtype == torch.float32
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    gh, gw = _grads(lp1.sum() + ent1.sum(), h, w)
    eh, ew = _grads(lp0.sum() + ent0.sum(), h, w)
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    torch.testing.assert_close(gh.float(), eh.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw.float(), ew.float(), atol=2e-2, rtol=2e-2)


def test_only_one_chunk_of_logits_is_ever_allocated():
    """The largest float32 tensor created in forward + backward is chunk x V, never N x V."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Biggest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.max_numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.max_numel = max(self.max_numel, t.numel())
            return out

    N, H, V, chunk = 64, 8, 300, 8
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (N,))
    with Biggest() as mode:
        lp, ent = log_probs_from_hidden(h, w, y, return_entropy=True, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()
    assert mode.max_numel <= max(chunk * V, V * H), mode.max_numel
    with Biggest() as full:
        lp0, ent0 = _full(h, w, y)
        (lp0.sum() + ent0.sum()).backward()
    assert full.max_numel >= N * V  # the check can fail: the old path trips it


def test_clear_errors():
    h, w, _, y, _ = _inputs()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        log_probs_from_hidden(h, w, torch.full_like(y, -100))
    with pytest.raises(ValueError, match="weight"):
        log_probs_from_hidden(h, w.t(), y)
    with pytest.raises(ValueError, match="disagree"):
        log_probs_from_hidden(h, w, y[:, :-1])
    with pytest.raises(ValueError, match="dtype"):
        log_probs_from_hidden(h.double(), w, y)
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_hidden(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        log_probs_from_hidden(h, w, y, chunk_size=0)


def test_empty_and_no_grad():
    h, w, _, y, _ = _inputs()
    lp, ent = log_probs_from_hidden(h[:, :0], w, y[:, :0], return_entropy=True)
    assert lp.shape == (3, 0) and ent.shape == (3, 0)
    with torch.no_grad():
        lp, _ = log_probs_from_hidden(h, w, y)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, _full(h, w, y)[0].detach(), atol=ATOL, rtol=0)
