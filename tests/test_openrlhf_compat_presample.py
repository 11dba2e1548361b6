"""CPU stand-ins (flash_attn padding helpers, vLLM import stub), the pre-sampling stage's
pure parts and file layout, and evaluation scoring."""
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


# ------------------------------------------------------------------ pre-sampling
from openrlhf_div.engines.openrlhf import presample as P  # noqa: E402
from openrlhf_div.engines.openrlhf.pef import AnchorPool, read_exp, read_pef  # noqa: E402


def _chunk(rewards_per_prompt):
    rows = [{"id": f"q{i}", "prompt": f"question {i}", "label": str(i)} for i in range(len(rewards_per_prompt))]
    texts = [f"<chat>question {i}" for i in range(len(rows))]
    pids = [[1, 2, 3 + i] for i in range(len(rows))]
    samples = [[P.Sample([10 + j, 20 + j], f"answer {j}", float(r)) for j, r in enumerate(rs)]
               for rs in rewards_per_prompt]
    return rows, texts, pids, samples


def test_split_chunk_follows_the_dph_rule():
    rows, texts, pids, samples = _chunk([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]])
    pef, exp, counts = P.split_chunk(rows, texts, pids, samples, n_pre=4, tau=4, drop_unsolved=False)
    assert counts == [4, 3, 0, 1]
    assert [r["id"] for r in pef] == ["q0"] and [r["id"] for r in exp] == ["q1", "q2", "q3"]
    assert pef[0]["response_ids"] == [10, 20] and pef[0]["prompt_text"] == "<chat>question 0"
    pef, exp, _ = P.split_chunk(rows, texts, pids, samples, n_pre=4, tau=3, drop_unsolved=True)
    assert [r["id"] for r in pef] == ["q0", "q1"] and [r["id"] for r in exp] == ["q3"]
    assert pef[1]["response_ids"] == [11, 21]  # the FIRST correct sample of q1
    assert exp[0]["n_correct"] == 1 and exp[0]["n_pre"] == 4 and exp[0]["label"] == "3"
    with pytest.raises(ValueError, match="tau"):
        P.split_chunk(rows, texts, pids, samples, n_pre=4, tau=5, drop_unsolved=False)
    with pytest.raises(ValueError, match="expected n_pre=8"):
        P.split_chunk(rows, texts, pids, samples, n_pre=8, tau=8, drop_unsolved=False)


def test_split_chunk_with_fresh_anchor_draws():
    """resample_anchor_responses (seamoke/DPH-RL generate_sft): a near-perfect prompt's anchor is
    its fresh draw if correct, else it has none; D_exp is unchanged."""
    rows, texts, pids, samples = _chunk([[1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0]])
    fresh = [P.Sample([77], "fresh ok", 1.0), P.Sample([78], "fresh wrong", 0.0), None, None]
    pef, exp, counts = P.split_chunk(rows, texts, pids, samples, n_pre=4, tau=4, drop_unsolved=False, fresh=fresh)
    assert counts == [4, 4, 3, 0]
    assert [r["id"] for r in pef] == ["q0"] and pef[0]["response_ids"] == [77] and pef[0]["response"] == "fresh ok"
    assert [r["id"] for r in exp] == ["q2", "q3"]  # q1 lost its anchor and is not an online prompt either
    with pytest.raises(ValueError, match="fresh has 1 entries for 4 prompts"):
        P.split_chunk(rows, texts, pids, samples, n_pre=4, tau=4, drop_unsolved=False, fresh=fresh[:1])


def test_shard_store_counts_failed_fresh_draws(tmp_path):
    rows, texts, pids, samples = _chunk([[1, 1, 1, 1], [1, 1, 1, 1]])
    store = P.ShardStore(str(tmp_path / "ps"), _settings(chunk_size=2, resample_anchor_responses=True), n_prompts=2)
    pef, exp, n = P.split_chunk(rows, texts, pids, samples, n_pre=4, tau=4, drop_unsolved=False,
                                fresh=[P.Sample([5], "x", 1.0), P.Sample([6], "y", 0.0)])
    for r in pef:
        r["ref_log_probs"] = [-0.5]
    store.write_chunk(0, pef, exp, n)
    summary = store.assemble()
    assert summary["n_pef"] == 1 and summary["n_resample_failed"] == 1 and summary["n_exp"] == 0


def test_response_log_probs_positions():
    # T = 3 prompt + 2 response = 5 tokens -> 4 actor positions; response scored at [2, 4)
    assert P.response_log_probs([-9.0, -9.0, -0.5, -0.25], 3, 2) == [-0.5, -0.25]
    with pytest.raises(ValueError, match="no 3 response positions"):
        P.response_log_probs([-1.0, -1.0], 2, 3)


def _settings(**kw):
    s = {"n_pre": 4, "tau": 4, "drop_unsolved": False, "chunk_size": 2, "model": "m", "temperature": 1.0}
    s.update(kw)
    return s


def test_shard_store_resumes_and_assembles_local_engine_layout(tmp_path):
    out = str(tmp_path / "ps")
    rows, texts, pids, samples = _chunk([[1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]])
    store = P.ShardStore(out, _settings(), n_prompts=3)
    assert store.todo() == [0, 1] and store.bounds(1) == (2, 3)
    for c in store.todo()[:1]:  # "interrupted" after chunk 0
        lo, hi = store.bounds(c)
        pef, exp, n = P.split_chunk(rows[lo:hi], texts[lo:hi], pids[lo:hi], samples[lo:hi], n_pre=4, tau=4,
                                    drop_unsolved=False)
        for r in pef:
            r["ref_log_probs"] = [-0.1, -0.2]
        store.write_chunk(c, pef, exp, n)
    with pytest.raises(RuntimeError, match="still to sample"):
        store.assemble()
    with pytest.raises(FileNotFoundError, match="unfinished pre-sampling run"):
        read_pef(out)
    again = P.ShardStore(out, _settings(), n_prompts=3)  # a rerun skips finished chunks
    assert again.todo() == [1]
    with pytest.raises(ValueError, match="different settings .*tau"):
        P.ShardStore(out, _settings(tau=3), n_prompts=3)
    lo, hi = again.bounds(1)
    pef, exp, n = P.split_chunk(rows[lo:hi], texts[lo:hi], pids[lo:hi], samples[lo:hi], n_pre=4, tau=4,
                                drop_unsolved=False)
    for r in pef:
        r["ref_log_probs"] = [-0.3, -0.4]
    again.write_chunk(1, pef, exp, n)
    summary = again.assemble()
    assert summary["n_pef"] == 2 and summary["n_exp"] == 1 and summary["correct_histogram"] == [0, 0, 1, 0, 2]
    assert sorted(os.listdir(out)) == ["d_exp.jsonl", "d_pef.jsonl", "shards", "summary.json"]
    recs = read_pef(out)
    assert [r.id for r in recs] == ["q0", "q2"] and recs[1].ref_log_probs == [-0.3, -0.4]
    assert recs[0].prompt == "<chat>question 0" and recs[0].prompt_ids == [1, 2, 3]
    assert read_exp(out)[0]["id"] == "q1"
    assert len(AnchorPool(recs).draw(5)) == 5


def test_reads_a_local_engine_d_pef_record(tmp_path):
    """A row as the local engine's `openrlhf-div presample` writes it."""
    row = {"prompt": "Q", "label": "4", "source": "demo", "id": "demo-1", "prompt_text": "<t>Q",
           "response": "4", "prompt_ids": [3, 4], "response_ids": [5], "ref_log_probs": [-0.7],
           "n_correct": 8, "n_pre": 8}
    (tmp_path / "d_pef.jsonl").write_text(json.dumps(row) + "\n")
    rec, = read_pef(str(tmp_path))
    assert (rec.prompt, rec.response_ids, rec.ref_log_probs, rec.id) == ("<t>Q", [5], [-0.7], "demo-1")


@pytest.mark.parametrize("bad,msg", [({"response_ids": [5, 6]}, "must align"), ({"ref_log_probs": [0.5]}, "<= 0"),
                                     ({"response_ids": []}, "empty")])
def test_bad_d_pef_records_are_named(tmp_path, bad, msg):
    row = {"prompt_ids": [3], "response_ids": [5], "ref_log_probs": [-0.7], **bad}
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=msg):
        read_pef(str(f))


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
