"""The Megatron actor's loss path (vocab-parallel log-probs from hidden states -> registry loss)
equals the registry's loss on unsharded full logits: values and gradients of the hidden states and
of the output layer, TP=2 over gloo, several methods, and micro-batch sums equal one token-mean
over the whole step."""
import pytest
import torch

from openrlhf_div.algorithms import get_method
from openrlhf_div.algorithms.registry import AnchorInputs, LossInputs
from openrlhf_div.engines.megatron.loss import MicroBatch, StepCounts, registry_loss, step_counts, token_log_probs_entropy
from openrlhf_div.compat.mcore_cpu import run_multiprocess
from openrlhf_div.engines.megatron.vocab_parallel import vocab_range

METHODS = ["grpo", "dph_js", "dph_f", "entropy_bonus", "rkl", "lad_js", "ds_grpo"]
B, L, A, V, VP, TEMP = 6, 9, 5, 23, 24, 0.8   # VP: Megatron-padded vocabulary (1 padding row)
HD = 7  # hidden size


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, HD, generator=g) * 2
    weight = torch.randn(VP, HD, generator=g) / HD ** 0.5 * 2
    seq = torch.randint(0, V, (B, L), generator=g)
    mask = (torch.rand(B, A, generator=g) > 0.25).float()
    mask[:, 0] = 1
    is_anchor = torch.tensor([False, False, True, False, True, False])
    return dict(
        hidden=hidden, weight=weight, sequences=seq, attention_mask=torch.ones(B, L, dtype=torch.long), action_mask=mask,
        old_log_probs=-torch.rand(B, A, generator=g) * 3, advantages=torch.randn(B, generator=g)[:, None] * mask,
        ref_log_probs=-torch.rand(B, A, generator=g) * 3, correct=torch.rand(B, generator=g) > 0.5,
        is_anchor=is_anchor, anchor_ref_log_probs=-torch.rand(B, A, generator=g) * 3,
    )


def _mb(d, rows, logits=None):
    keys = ["sequences", "attention_mask", "action_mask", "old_log_probs", "advantages", "ref_log_probs",
            "correct", "is_anchor", "anchor_ref_log_probs"]
    return MicroBatch(**{k: d[k][rows] for k in keys})


def _method(name):
    m = get_method(name)
    if not m.needs.anchor_batch:
        return m
    return m


SPLITS = [slice(0, 3), slice(3, 6)]  # two micro-batches of one optimiser step


def _worker(rank, world):
    import torch.distributed as dist
    out = {}
    d = _data()
    start, end = vocab_range(VP, rank, world)
    for name in METHODS:
        method = get_method(name)
        hid = d["hidden"].clone().requires_grad_(True)
        shard = d["weight"][start:end].clone().requires_grad_(True)
        mbs = [_mb(d, s) for s in SPLITS]
        if not method.needs.anchor_batch:
            for mb in mbs:
                mb.is_anchor = None
        counts = step_counts(mbs)
        total, metrics = 0.0, []
        for s, mb in zip(SPLITS, mbs):
            lp, h = token_log_probs_entropy(hid[s], shard, mb.sequences, A, vocab_start=start, vocab_size=V,
                                            temperature=TEMP, group=dist.group.WORLD,
                                            need_entropy=method.needs.entropy)
            loss, met, w = registry_loss(method, lp, h, mb, counts)
            loss.backward()
            total += float(loss.detach())
            metrics.append((met, w))
        out[name] = dict(loss=total, grad=shard.grad.clone(), grad_h=hid.grad.clone(), counts=counts, metrics=metrics)
    return out


@pytest.fixture(scope="module")
def tp2():
    return run_multiprocess(_worker, world_size=2, timeout=60)


def _reference(name):
    """Unsharded: log_softmax on the full logits, one registry call over the whole step."""
    d = _data()
    method = get_method(name)
    hid = d["hidden"].clone().requires_grad_(True)
    full = d["weight"].clone().requires_grad_(True)
    logp = torch.log_softmax(hid[:, L - 1 - A: L - 1] @ full[:V].t() / TEMP, dim=-1)
    lp = logp.gather(-1, d["sequences"][:, L - A:, None])[..., 0]
    h = -(logp.exp() * logp).sum(-1)
    anchor = d["is_anchor"] if method.needs.anchor_batch else torch.zeros(B, dtype=torch.bool)
    on = ~anchor
    online = LossInputs(log_probs=lp[on], old_log_probs=d["old_log_probs"][on], advantages=d["advantages"][on],
                        mask=d["action_mask"][on], correct=d["correct"][on], entropy=h[on],
                        ref_log_probs=d["ref_log_probs"][on])
    anc = None
    if anchor.any():
        anc = AnchorInputs(log_probs=lp[anchor], ref_log_probs=d["anchor_ref_log_probs"][anchor],
                           mask=d["action_mask"][anchor])
    loss, _ = method.loss(online=online, anchor=anc)
    loss.backward()
    return float(loss.detach()), full.grad, hid.grad


@pytest.mark.parametrize("name", METHODS)
def test_tp2_loss_and_grad_equal_registry(tp2, name):
    ref_loss, ref_grad, ref_grad_h = _reference(name)
    for res in tp2:
        assert res[name]["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(res[name]["grad_h"], ref_grad_h, rtol=1e-4, atol=1e-6)
    grad = torch.cat([res[name]["grad"] for res in tp2], dim=0)
    torch.testing.assert_close(grad[:V], ref_grad[:V], rtol=1e-4, atol=1e-6)
    assert torch.all(grad[V:] == 0)
    assert ref_grad.abs().sum() > 0


def test_counts_are_global_step_counts(tp2):
    d = _data()
    c = tp2[0]["dph_js"]["counts"]
    on, an = ~d["is_anchor"], d["is_anchor"]
    assert c.online_tokens == float(d["action_mask"][on].sum())
    assert c.anchor_tokens == float(d["action_mask"][an].sum())
    assert c.online_seqs == float(on.sum())
    c2 = tp2[0]["grpo"]["counts"]   # no anchor loss: every row is online
    assert c2.online_tokens == float(d["action_mask"].sum()) and c2.anchor_tokens == 0


def test_metric_weights(tp2):
    met, w = tp2[0]["dph_js"]["metrics"][0]
    assert w["loss"] is None and w["loss_pef"] is None
    assert w["clipfrac"] > 0


def test_anchor_rows_need_stored_ref():
    d = _data()
    mb = _mb(d, slice(0, 6))
    mb.anchor_ref_log_probs = None
    lp = torch.zeros(B, A)
    with pytest.raises(ValueError, match="anchor_ref_log_probs"):
        registry_loss(get_method("dph_js"), lp, None, mb, StepCounts(10, 10, 4))
    with pytest.raises(ValueError, match="no anchor loss"):
        registry_loss(get_method("grpo"), lp, None, _mb(d, slice(0, 6)), StepCounts(10, 10, 4))
