"""HiddenLogProbActor (the OpenRLHF policy / reference actor's model) equals OpenRLHF's own
``Actor.forward`` -- padded and packed sequences, temperature, entropy, gradients -- and never
allocates a [tokens, V] float32 tensor."""
import pytest
import torch

from openrlhf_div.compat import install_flash_attn_standin, install_vllm_stub

install_flash_attn_standin()
install_vllm_stub()

from openrlhf.models import Actor  # noqa: E402

from openrlhf_div.engines.local.tiny import build_tiny_model  # noqa: E402
from openrlhf_div.engines.openrlhf.logprob_actor import DivReferenceModelActor, HiddenLogProbActor  # noqa: E402

VOCAB = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [f"w{i}" for i in range(150)]  # V = 180
ATOL = 1e-5


def _pair(model, packing, temperature):
    old, new = Actor(model, temperature=temperature), HiddenLogProbActor(model, temperature=temperature)
    for a in (old, new):  # Actor(model_instance) leaves these unset
        a.packing_samples = packing
    return old, new


def _batch():
    """OpenRLHF's layout: right-padded sequences, action mask over the last A of the L-1 targets."""
    g = torch.Generator().manual_seed(0)
    lens, prompt = [9, 6, 8], 3
    L = max(lens)
    seq = torch.zeros(len(lens), L, dtype=torch.long)
    am = torch.zeros(len(lens), L, dtype=torch.long)
    for i, n in enumerate(lens):
        seq[i, :n] = torch.randint(4, len(VOCAB) + 4, (n,), generator=g)
        am[i, :n] = 1
    act = am[:, 1:].clone()
    act[:, : prompt - 1] = 0
    A = L - prompt
    return seq, am, act[:, -A:].float()


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_tiny_model(VOCAB, seed=4, hidden_size=32, num_layers=1)
    return model, len(tok)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_forward_values_and_gradients_equal_openrlhf(tiny, packing, T):
    model, _ = tiny
    old, new = _pair(model, packing, T)
    seq, am, act = _batch()
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    c1, c2 = torch.randn(act.shape, generator=g), torch.randn(act.shape, generator=g)
    outs = []
    for actor in (old, new):
        lp, out = actor(seq, act, attention_mask=am, return_output=True, return_entropy=True)
        ent = out.entropy[:, -act.shape[1]:]
        loss = (c1 * lp + c2 * ent * act).sum()
        outs.append((lp.detach(), out.entropy.detach(), torch.autograd.grad(loss, params)))
    (lp0, e0, g0), (lp1, e1, g1) = outs
    assert e1.shape == e0.shape
    torch.testing.assert_close(lp1, lp0, atol=ATOL, rtol=0)
    torch.testing.assert_close(e1, e0, atol=ATOL, rtol=0)
    for a, e in zip(g1, g0):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)
    # the reference / old-log-prob call: no_grad, no output
    with torch.no_grad():
        torch.testing.assert_close(new(seq, act, attention_mask=am), old(seq, act, attention_mask=am), atol=ATOL, rtol=0)
        r0 = old(seq, None, attention_mask=am, return_logprobs=True)
        r1 = new(seq, None, attention_mask=am, return_logprobs=True)
    torch.testing.assert_close(r1, r0, atol=ATOL, rtol=0)


def test_no_tokens_by_vocab_tensor_and_logits_requests_fall_back(tiny):
    from torch.utils._python_dispatch import TorchDispatchMode

    model, V = tiny
    seq, am, act = _batch()

    class Probe(TorchDispatchMode):
        max_rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shared = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] == V
                        and t.untyped_storage().data_ptr() not in shared):
                    self.max_rows = max(self.max_rows, t.numel() // V)
            return out

    from openrlhf_div.algorithms import logprobs as lp_mod

    old_chunk, lp_mod.DEFAULT_CHUNK_ELEMENTS = lp_mod.DEFAULT_CHUNK_ELEMENTS, 4 * V
    try:
        old, new = _pair(model, False, 0.8)
        with Probe() as p_new:
            lp, out = new(seq, act, attention_mask=am, return_output=True, return_entropy=True)
            (lp.sum() + out.entropy.sum()).backward()
        with Probe() as p_old:
            lp, out = old(seq, act, attention_mask=am, return_output=True, return_entropy=True)
            (lp.sum() + out.entropy.sum()).backward()
    finally:
        lp_mod.DEFAULT_CHUNK_ELEMENTS = old_chunk
        model.zero_grad(set_to_none=True)
    assert out.logits is not None
    assert 0 < p_new.max_rows <= 4 and p_old.max_rows >= seq.numel(), (p_new.max_rows, p_old.max_rows)
    with torch.no_grad():  # logits requested: OpenRLHF's forward, logits included
        full = new(seq, None, attention_mask=am, return_output=True)
    assert full.logits.shape == (*seq.shape, V) and full.logits.dtype == torch.float32


def test_reference_actor_class_builds_the_hidden_actor():
    from openrlhf.trainer.ray import launcher

    cls = DivReferenceModelActor.__ray_actor_class__
    assert issubclass(cls, launcher.ReferenceModelActor.__ray_actor_class__)
    seen = {}

    class Probe(cls):
        def _setup_distributed(self, strategy):
            seen["Actor"] = launcher.Actor
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        Probe.init_model_from_pretrained(Probe.__new__(Probe), None, "x")
    assert seen["Actor"] is HiddenLogProbActor and launcher.Actor is Actor
