"""Engine forwards compute log-probs / entropy from hidden states: same values and gradients as the
full-logits computation, and no [tokens, V] float32 tensor is ever allocated (forward or backward)."""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from openrlhf_div.algorithms import logprobs as lp_mod
from openrlhf_div.engines.lm_head import UnsupportedHead, lm_head_returns_hidden
from openrlhf_div.engines.local.generation import pack_sequences, position_ids_from_mask, response_forward
from openrlhf_div.engines.local.tiny import build_tiny_model

VOCAB = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [f"w{i}" for i in range(150)]  # V = 180
ATOL = 1e-5


class VocabTensorProbe(TorchDispatchMode):
    """Records the largest newly allocated float32 tensor whose last dimension is the vocabulary
    size ``V`` (views and in-place results share an input's storage and are not counted)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.max_rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        shared = {a.untyped_storage().data_ptr() for a in inputs}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] == self.vocab
                    and t.untyped_storage().data_ptr() not in shared):
                self.max_rows = max(self.max_rows, t.numel() // self.vocab)
        return out


@contextlib.contextmanager
def small_chunks(rows: int, vocab: int):
    """Chunks of ``rows`` tokens, so a tiny batch spans several chunks."""
    old = lp_mod.DEFAULT_CHUNK_ELEMENTS
    lp_mod.DEFAULT_CHUNK_ELEMENTS = rows * vocab
    try:
        yield
    finally:
        lp_mod.DEFAULT_CHUNK_ELEMENTS = old


def _batch(tok):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    responses = [[20, 30, 40, 50, 60, 70], [21, 31], [22, 32, 42, 52]]
    return pack_sequences(prompts, responses, tok.pad_token_id)


def _full_logits_forward(model, ids, attn, rmask, T):
    """The pre-#12 response_forward: full [N, R, V] float32 logits -> log_softmax."""
    R = rmask.shape[1]
    P = ids.shape[1] - R
    out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn), use_cache=False,
                logits_to_keep=R + 1)
    logp = torch.log_softmax(out.logits[:, :-1, :].float() / T, dim=-1)
    m = rmask.float()
    lp = logp.gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1) * m
    return lp, -(logp.exp() * logp).sum(-1) * m


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(VOCAB, seed=2, hidden_size=32, num_layers=1)


@pytest.mark.parametrize("T", [1.0, 0.6])
def test_local_response_forward_matches_full_logits(tiny, T):
    model, tok = tiny
    ids, attn, rmask = _batch(tok)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    c1, c2 = torch.randn(rmask.shape, generator=g), torch.randn(rmask.shape, generator=g)
    lp0, ent0 = _full_logits_forward(model, ids, attn, rmask, T)
    with small_chunks(3, len(tok)):
        fo = response_forward(model, ids, attn, rmask, temperature=T, return_entropy=True)
    torch.testing.assert_close(fo.log_probs, lp0, atol=ATOL, rtol=0)
    torch.testing.assert_close(fo.entropy, ent0, atol=ATOL, rtol=0)
    assert bool((fo.log_probs[rmask == 0] == 0).all()) and bool((fo.entropy[rmask == 0] == 0).all())
    g0 = torch.autograd.grad((c1 * lp0 + c2 * ent0).sum(), params)
    g1 = torch.autograd.grad((c1 * fo.log_probs + c2 * fo.entropy).sum(), params)
    for a, e in zip(g1, g0):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)
    fd = response_forward(model, ids, attn, rmask, temperature=T, return_entropy="detached")
    assert not fd.entropy.requires_grad and fd.log_probs.requires_grad
    torch.testing.assert_close(fd.entropy, ent0.detach(), atol=ATOL, rtol=0)


def test_local_engine_never_holds_tokens_by_vocab_logits(tiny):
    model, tok = tiny
    V = len(tok)
    ids, attn, rmask = _batch(tok)
    tokens = rmask.numel()
    with small_chunks(4, V):
        with VocabTensorProbe(V) as train:  # training forward + backward
            fo = response_forward(model, ids, attn, rmask, temperature=0.7, return_entropy=True)
            (fo.log_probs.sum() + fo.entropy.sum()).backward()
        with torch.no_grad(), VocabTensorProbe(V) as nograd:  # old / reference / pre-sampling log-probs
            response_forward(model, ids, attn, rmask, temperature=0.7)
    model.zero_grad(set_to_none=True)
    assert 0 < train.max_rows <= 4 and 0 < nograd.max_rows <= 4, (train.max_rows, nograd.max_rows)
    with VocabTensorProbe(V) as old:  # the probe does catch the full-logits path
        lp0, ent0 = _full_logits_forward(model, ids, attn, rmask, 0.7)
        (lp0.sum() + ent0.sum()).backward()
    model.zero_grad(set_to_none=True)
    assert old.max_rows >= tokens


def test_lm_head_swap_is_restored_and_refuses_logit_transforms(tiny):
    model, _ = tiny
    head = model.get_output_embeddings()
    with pytest.raises(RuntimeError, match="boom"):
        with lm_head_returns_hidden(model):
            assert "forward" in head.__dict__
            raise RuntimeError("boom")
    assert "forward" not in head.__dict__
    model.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(UnsupportedHead, match="final_logit_softcapping"):
            with lm_head_returns_hidden(model):
                pass
    finally:
        model.config.final_logit_softcapping = None
