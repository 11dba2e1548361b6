"""The lean decoder's static-shape token step (issue 41, item 6): fixed shapes, the key mask and the
write column on the device, no host synchronisation, so that CUDA can replay it as a graph.

It is not bit-exact with today's (dynamic-length) step on a CPU: the attention sums over the whole
preallocated cache, masked, and the kernel's summation order follows that length (measured: at most
2.4e-7 on the tiny model's logits; docs/benchmarks.md, "Static-shape decode step"). So the test holds
it bit-exact with itself across runs, to the same sampled tokens as the dynamic step on the tiny model,
and to the dynamic step's log-probs within LP_TOL."""
from __future__ import annotations

import contextlib

import pytest
import torch

from helpers import VOCAB
from openrlhf_div.engines.local import fastgen
from openrlhf_div.engines.local.generation import generate
from openrlhf_div.engines.local.tiny import build_tiny_model

@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: these tiny models run ~50x slower with two threads on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


LP_TOL = 1e-5   # float32 log-probs, static vs dynamic step (measured differences: ~1e-7)
PROMPTS = ["ab=", "abcdef=", "f="]


def _model():
    model, tok = build_tiny_model(VOCAB, seed=1)
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 2.0   # rows stop at different steps: finished rows' pad keys get masked
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    return model, tok


def _gen(model, tok, step, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    kw = dict(dict(n_samples=4, max_new_tokens=20, temperature=1.2), **kw)
    return generate(model, tok, PROMPTS, generator=g, decode_step=step, **kw), g


def test_static_step_is_reproducible_and_matches_the_dynamic_step():
    model, tok = _model()
    stopped_early = 0
    for seed in range(3):
        s1, g1 = _gen(model, tok, "static", seed)
        s2, g2 = _gen(model, tok, "static", seed, stop_check_every=4)
        d, gd = _gen(model, tok, "dynamic", seed)
        # bit for bit with itself (and with a deferred stop check)
        assert s1.response_ids == s2.response_ids and torch.equal(s1.log_probs, s2.log_probs)
        assert torch.equal(g1.get_state(), g2.get_state())
        # the same samples as the dynamic step, log-probs within LP_TOL
        assert s1.response_ids == d.response_ids and torch.equal(s1.response_mask, d.response_mask)
        assert torch.equal(s1.input_ids, d.input_ids) and torch.equal(s1.finished, d.finished)
        assert torch.equal(g1.get_state(), gd.get_state())
        assert (s1.log_probs - d.log_probs).abs().max().item() <= LP_TOL
        stopped_early += int((~s1.finished).sum() < len(s1.finished))   # some row stopped at eos
    assert stopped_early


def test_static_step_greedy_matches_dynamic():
    model, tok = build_tiny_model(VOCAB, seed=1)   # no eos bias: greedy rows run all 30 steps
    s, _ = _gen(model, tok, "static", 0, temperature=0.0, n_samples=1, max_new_tokens=30)
    d, _ = _gen(model, tok, "dynamic", 0, temperature=0.0, n_samples=1, max_new_tokens=30)
    assert s.response_lengths.tolist() == [30, 30, 30]
    assert s.response_ids == d.response_ids
    assert (s.log_probs - d.log_probs).abs().max().item() <= LP_TOL


class _FakeGraph:
    """CPU stand-in for torch.cuda.CUDAGraph: replay re-runs the decoder's step on its buffers."""

    decoder = None

    def replay(self):
        self.decoder.out.copy_(self.decoder._static_step())


def test_graph_step_plumbing_on_cpu(monkeypatch):
    """The graph path's protocol (warm-up runs undone, inputs copied into the fixed buffers before
    each replay, the output copied out) gives the static step's numbers; the CUDA graph itself only
    runs on CUDA (benchmarks/gpu_bench.py, case decode)."""
    model, tok = _model()
    cuda = fastgen.torch.cuda

    @contextlib.contextmanager
    def fake_capture(graph):
        dec = _FakeGraph.decoder
        start = dec.cur.clone()
        yield   # the body runs eagerly here; a real capture runs nothing: set the state back
        dec.cur.copy_(start)

    stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(cuda, "Stream", stream)
    monkeypatch.setattr(cuda, "current_stream", stream)
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(cuda, "graph", fake_capture)
    real_init = fastgen.StaticLlamaDecoder.__init__

    def init(self, model, n_rows, max_len, graph=False):
        real_init(self, model, n_rows, max_len, graph=False)   # the CPU refuses graph=True
        self.use_graph = graph
        _FakeGraph.decoder = self

    monkeypatch.setattr(fastgen.StaticLlamaDecoder, "__init__", init)
    for seed in range(2):
        a, ga = _gen(model, tok, "graph", seed)
        b, gb = _gen(model, tok, "static", seed)
        assert a.response_ids == b.response_ids and torch.equal(a.log_probs, b.log_probs)
        assert torch.equal(ga.get_state(), gb.get_state())


def test_decode_step_refusals():
    model, tok = _model()
    with pytest.raises(ValueError, match="decode step 'graph' needs a CUDA model"):
        _gen(model, tok, "graph", 0)
    with pytest.raises(ValueError, match="decode step 'static' needs the lean decoder.*fast=False"):
        _gen(model, tok, "static", 0, fast=False)
    with pytest.raises(ValueError, match="decode step 'eager': one of dynamic, static, graph"):
        _gen(model, tok, "eager", 0)


def test_rollout_decode_step_reaches_the_sampler(tmp_path, monkeypatch):
    """``rollout.decode_step`` is the hf sampler's step in training; a bad name is refused at load."""
    from helpers import local_overrides, write_copy_last_data
    from openrlhf_div.engines.local.config import ConfigError, load_config
    from openrlhf_div.engines.local.trainer import Trainer

    data = write_copy_last_data(tmp_path)
    built = []
    real = fastgen.StaticLlamaDecoder.__init__

    def spy(self, *a, **kw):
        built.append(kw.get("graph"))
        real(self, *a, **kw)

    monkeypatch.setattr(fastgen.StaticLlamaDecoder, "__init__", spy)
    over = local_overrides(data, tmp_path / "run", extra=["rollout.backend=hf", "rollout.decode_step=static"])
    tr = Trainer(load_config(None, over))
    tr.train_step()
    assert built and built[0] is False
    with pytest.raises(ConfigError, match="rollout.decode_step must be dynamic, static or graph, got 'eager'"):
        load_config(None, local_overrides(data, tmp_path / "run2", extra=["rollout.decode_step=eager"]))
