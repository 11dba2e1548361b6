"""CPU stand-ins (flash_attn padding helpers, vLLM import stub), the OpenRLHF layout of the
pre-sampling forward, and evaluation scoring (the split rule and files: tests/test_anchor_data.py)."""
from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

from openrlhf_div.compat import flash_attn_standin as FA
from openrlhf_div.compat import vllm_stub as VS


# ------------------------------------------------------------------ flash_attn stand-in
def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    x = torch.randn(3, 5, 4, generator=g)
    return x, mask


def test_unpad_pad_roundtrip_and_layout():
    x, mask = _batch()
    flat, idx, cu, mx, used = FA.unpad_input(x, mask)
    naive = torch.cat([x[b, mask[b].bool()] for b in range(3)])
    torch.testing.assert_close(flat, naive)
    assert idx.tolist() == [0, 1, 2, 5, 6, 10, 11, 12, 13, 14]  # flat positions b * S + s
    assert cu.tolist() == [0, 3, 5, 10] and cu.dtype == torch.int32 and mx == 5 and used.tolist() == [3, 2, 5]
    back = FA.pad_input(flat, idx, 3, 5)
    torch.testing.assert_close(back, x * mask[..., None])
    torch.testing.assert_close(FA.index_first_axis(x.reshape(15, 4), idx), naive)


def test_standin_is_differentiable():
    x, mask = _batch(1)
    x.requires_grad_(True)
    flat, idx, *_ = FA.unpad_input(x, mask)
    FA.pad_input(flat * 2.0, idx, 3, 5).sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * mask[..., None].expand_as(x).float())


def test_openrlhf_packing_helpers_run_on_the_standin():
    FA.install()
    from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor

    seqs = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    attn = (seqs > 0).long()
    packed, pos, rolled, pad_len, idx = unpad_and_slice_tensor(seqs, attn, None)
    assert packed.tolist() == [[5, 6, 7, 8, 9]] and pos.tolist() == [[0, 1, 2, 0, 1]]
    assert rolled.tolist() == [[6, 7, 0, 9, 0]]
    back = gather_and_pad_tensor(packed.float(), None, pad_len, idx, 2, 4)
    assert back.tolist() == seqs.float().tolist()


def test_install_leaves_a_real_flash_attn_alone(monkeypatch):
    real = types.ModuleType("flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", real)
    assert FA.install() is False and sys.modules["flash_attn"] is real
    assert FA.real_flash_attn_present()


def test_transformers_does_not_see_the_standin_as_flash_attention():
    FA.install()
    from transformers.utils import is_flash_attn_2_available

    assert sys.modules["flash_attn"].__openrlhf_div_standin__ and not is_flash_attn_2_available()


def test_vllm_stub_imports_and_refuses_to_generate(monkeypatch):
    if VS.real_vllm_present():
        pytest.skip("a real vLLM is installed")
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, k)
    assert VS.install() is True
    import vllm
    from vllm import SamplingParams

    assert SamplingParams(temperature=0.7, n=2).temperature == 0.7
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        vllm.AsyncLLMEngine.from_engine_args(None)
    fake_real = types.ModuleType("vllm")
    monkeypatch.setitem(sys.modules, "vllm", fake_real)
    assert VS.install() is False and sys.modules["vllm"] is fake_real


# ------------------------------------------------------------------ pre-sampling (OpenRLHF layout)
from openrlhf_div.engines.openrlhf import presample as P  # noqa: E402


def test_response_log_probs_positions():
    # T = 3 prompt + 2 response = 5 tokens -> 4 actor positions; response scored at [2, 4)
    assert P.response_log_probs([-9.0, -9.0, -0.5, -0.25], 3, 2) == [-0.5, -0.25]
    with pytest.raises(ValueError, match="no 3 response positions"):
        P.response_log_probs([-1.0, -1.0], 2, 3)



# ------------------------------------------------------------------ evaluation scoring
def test_vllm_driver_evaluation_uses_the_one_evaluation(tmp_path):
    """The OpenRLHF driver's evaluation is the project's evaluate() + write_eval() with its own
    generate function and renderer: task verdicts, styles, and the common eval.json."""
    from openrlhf_div.engines.openrlhf.evaluate import normalize_examples, run_evaluation
    from openrlhf_div.eval.results import read_eval_json
    from openrlhf_div.tasks.base import RewardResult, Task

    class Echo(Task):
        name = "echo"

        def score(self, response, label):
            if response == "boom":
                raise RuntimeError("verifier crashed")
            ok = response.strip() == str(label)
            return RewardResult(float(ok), ok, info={"style": response[:1]})

    exs = normalize_examples([{"id": "a", "q": "p", "label": "1", "source": "s1"}, {"q": "q", "label": "2"}],
                             input_key="q")
    texts = {"<p>": ["1", "x", "1"], "<q>": ["2", "boom", "3"]}
    seen = []

    def gen(prompts, n, **kw):
        seen.extend(prompts)
        return [texts[p][:n] for p in prompts]

    run_evaluation(Echo(), exs, gen, lambda ex: f"<{ex['prompt']}>", out=str(tmp_path), name="m", n=3,
                   max_new_tokens=7)
    assert seen == ["<p>", "<q>"]
    d = read_eval_json(str(tmp_path))
    recs = d["problems"]
    assert recs[0]["id"] == "a" and recs[0]["source"] == "s1" and recs[0]["correct"] == [1, 0, 1]
    assert recs[0]["styles"] == ["1", "x", "1"]
    assert recs[1]["id"] == "1" and recs[1]["correct"] == [1, 0, 0] and recs[1]["source"] == "default"
    assert d["settings"]["n"] == 3 and d["settings"]["max_new_tokens"] == 7 and d["settings"]["engine"] == "vllm"
    assert d["metrics"]["pass@1"] == pytest.approx((2 / 3 + 1 / 3) / 2)
