"""The sampler reads "has every row stopped?" on the host only every few steps (issue 41, item 6: a
device synchronisation per token step on a GPU), without changing anything it returns: samples,
log-probs, masks and the generator's state afterwards equal those of a check every step, bit for bit."""
from __future__ import annotations

import pytest
import torch

from helpers import VOCAB
from openrlhf_div.engines.local.generation import generate
from openrlhf_div.engines.local.tiny import build_tiny_model


@pytest.mark.parametrize("fast", [True, False])
def test_deferred_stop_check_changes_nothing(fast):
    model, tok = build_tiny_model(VOCAB, seed=1)
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 3.0   # rows stop after a few tokens, at different steps
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    prompts = ["ab=", "abcdef=", "f="]
    kw = dict(n_samples=4, max_new_tokens=24, temperature=1.3, fast=fast)
    stopped_early = 0
    for seed in range(4):
        g1, g5 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        a = generate(model, tok, prompts, generator=g1, stop_check_every=1, **kw)
        b = generate(model, tok, prompts, generator=g5, stop_check_every=5, **kw)
        assert a.response_ids == b.response_ids
        assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.response_mask, b.response_mask)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.finished, b.finished)
        assert torch.equal(g1.get_state(), g5.get_state())   # the next call samples the same
        stopped_early += a.response_mask.shape[1] < kw["max_new_tokens"]
    assert stopped_early   # the path that drops the steps past the last stop ran
    with pytest.raises(ValueError, match="stop_check_every=0"):
        generate(model, tok, prompts, generator=torch.Generator().manual_seed(0), stop_check_every=0, **kw)
