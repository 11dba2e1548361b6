"""The engine-neutral DPH anchor data (openrlhf_div.engines.anchor_data): the D_pef / D_exp
split rule, the chunk store and summary, the record reader, the sampler and the guards, used
by the local engine (`openrlhf-div presample`, the local trainer) and the OpenRLHF / Megatron
engines (`presample_ray`, the experience maker). Pure Python + numpy: about 1 s."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from openrlhf_div.engines import anchor_data as A


def _chunk(rewards_per_prompt):
    rows = [{"id": f"q{i}", "prompt": f"question {i}", "label": str(i)} for i in range(len(rewards_per_prompt))]
    texts = [f"<chat>question {i}" for i in range(len(rows))]
    pids = [[1, 2, 3 + i] for i in range(len(rows))]
    samples = [[A.Sample([10 + j, 20 + j], f"answer {j}", float(r)) for j, r in enumerate(rs)]
               for rs in rewards_per_prompt]
    return rows, texts, pids, samples


def test_split_chunk_follows_the_dph_rule():
    rows, texts, pids, samples = _chunk([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]])
    pef, exp, counts = A.split_chunk(rows, texts, pids, samples, n_pre=4, tau=4, drop_unsolved=False)
    assert counts == [4, 3, 0, 1]
    assert [r["id"] for r in pef] == ["q0"] and [r["id"] for r in exp] == ["q1", "q2", "q3"]
    assert pef[0]["response_ids"] == [10, 20] and pef[0]["prompt_text"] == "<chat>question 0"
    pef, exp, _ = A.split_chunk(rows, texts, pids, samples, n_pre=4, tau=3, drop_unsolved=True)
    assert [r["id"] for r in pef] == ["q0", "q1"] and [r["id"] for r in exp] == ["q3"]
    assert pef[1]["response_ids"] == [11, 21]  # the FIRST correct sample of q1
    assert exp[0]["n_correct"] == 1 and exp[0]["n_pre"] == 4 and exp[0]["label"] == "3"
    with pytest.raises(ValueError, match="tau"):
        A.split_chunk(rows, texts, pids, samples, n_pre=4, tau=5, drop_unsolved=False)
    with pytest.raises(ValueError, match="expected n_pre=8"):
        A.split_chunk(rows, texts, pids, samples, n_pre=8, tau=8, drop_unsolved=False)


def test_split_chunk_with_fresh_anchor_draws():
    """resample_anchor_responses (seamoke/DPH-RL generate_sft): a near-perfect prompt's anchor is
    its fresh draw if correct, else it has none; D_exp is unchanged."""
    rows, texts, pids, samples = _chunk([[1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0]])
    fresh = [A.Sample([77], "fresh ok", 1.0), A.Sample([78], "fresh wrong", 0.0), None, None]
    pef, exp, counts = A.split_chunk(rows, texts, pids, samples, n_pre=4, tau=4, drop_unsolved=False, fresh=fresh)
    assert counts == [4, 4, 3, 0]
    assert [r["id"] for r in pef] == ["q0"] and pef[0]["response_ids"] == [77] and pef[0]["response"] == "fresh ok"
    assert [r["id"] for r in exp] == ["q2", "q3"]  # q1 lost its anchor and is not an online prompt either
    with pytest.raises(ValueError, match="fresh has 1 entries for 4 prompts"):
        A.split_chunk(rows, texts, pids, samples, n_pre=4, tau=4, drop_unsolved=False, fresh=fresh[:1])


def test_shard_store_counts_failed_fresh_draws(tmp_path):
    rows, texts, pids, samples = _chunk([[1, 1, 1, 1], [1, 1, 1, 1]])
    store = A.ShardStore(str(tmp_path / "ps"), _settings(chunk_size=2, resample_anchor_responses=True), n_prompts=2)
    pef, exp, n = A.split_chunk(rows, texts, pids, samples, n_pre=4, tau=4, drop_unsolved=False,
                                fresh=[A.Sample([5], "x", 1.0), A.Sample([6], "y", 0.0)])
    for r in pef:
        r["ref_log_probs"] = [-0.5]
    store.write_chunk(0, pef, exp, n)
    summary = store.assemble()
    assert summary["n_pef"] == 1 and summary["n_resample_failed"] == 1 and summary["n_exp"] == 0


def _settings(**kw):
    s = {"n_pre": 4, "tau": 4, "drop_unsolved": False, "chunk_size": 2, "model": "m", "temperature": 1.0}
    s.update(kw)
    return s


def test_shard_store_resumes_and_assembles_local_engine_layout(tmp_path):
    out = str(tmp_path / "ps")
    rows, texts, pids, samples = _chunk([[1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]])
    store = A.ShardStore(out, _settings(), n_prompts=3)
    assert store.todo() == [0, 1] and store.bounds(1) == (2, 3)
    for c in store.todo()[:1]:  # "interrupted" after chunk 0
        lo, hi = store.bounds(c)
        pef, exp, n = A.split_chunk(rows[lo:hi], texts[lo:hi], pids[lo:hi], samples[lo:hi], n_pre=4, tau=4,
                                    drop_unsolved=False)
        for r in pef:
            r["ref_log_probs"] = [-0.1, -0.2]
        store.write_chunk(c, pef, exp, n)
    with pytest.raises(RuntimeError, match="still to sample"):
        store.assemble()
    with pytest.raises(FileNotFoundError, match="unfinished pre-sampling run"):
        A.read_pef(out)
    again = A.ShardStore(out, _settings(), n_prompts=3)  # a rerun skips finished chunks
    assert again.todo() == [1]
    with pytest.raises(ValueError, match="different settings .*tau"):
        A.ShardStore(out, _settings(tau=3), n_prompts=3)
    lo, hi = again.bounds(1)
    pef, exp, n = A.split_chunk(rows[lo:hi], texts[lo:hi], pids[lo:hi], samples[lo:hi], n_pre=4, tau=4,
                                drop_unsolved=False)
    for r in pef:
        r["ref_log_probs"] = [-0.3, -0.4]
    again.write_chunk(1, pef, exp, n)
    summary = again.assemble()
    assert summary["n_pef"] == 2 and summary["n_exp"] == 1 and summary["correct_histogram"] == [0, 0, 1, 0, 2]
    assert sorted(os.listdir(out)) == ["d_exp.jsonl", "d_pef.jsonl", "shards", "summary.json"]
    recs = A.read_pef(out)
    assert [r.id for r in recs] == ["q0", "q2"] and recs[1].ref_log_probs == [-0.3, -0.4]
    assert recs[0].prompt == "<chat>question 0" and recs[0].prompt_ids == [1, 2, 3]
    assert A.read_exp(out)[0]["id"] == "q1"
    assert len(A.AnchorSampler(recs).draw(5)) == 5


def test_reads_a_local_engine_d_pef_record(tmp_path):
    """A row as the local engine's `openrlhf-div presample` writes it."""
    row = {"prompt": "Q", "label": "4", "source": "demo", "id": "demo-1", "prompt_text": "<t>Q",
           "response": "4", "prompt_ids": [3, 4], "response_ids": [5], "ref_log_probs": [-0.7],
           "n_correct": 8, "n_pre": 8}
    (tmp_path / "d_pef.jsonl").write_text(json.dumps(row) + "\n")
    rec, = A.read_pef(str(tmp_path))
    assert (rec.prompt, rec.response_ids, rec.ref_log_probs, rec.id) == ("<t>Q", [5], [-0.7], "demo-1")


@pytest.mark.parametrize("bad,msg", [({"response_ids": [5, 6]}, "must align"), ({"ref_log_probs": [0.5]}, "<= 0"),
                                     ({"response_ids": []}, "empty")])
def test_bad_d_pef_records_are_named(tmp_path, bad, msg):
    row = {"prompt_ids": [3], "response_ids": [5], "ref_log_probs": [-0.7], **bad}
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=msg):
        A.read_pef(str(f))




def test_task_verdict_overrides_the_reward_threshold():
    """The local engine scores with the task's verdict (``correct``), OpenRLHF with ``reward >=
    correct_threshold``: the same rule either way."""
    yes, no = A.Sample([1], "a", reward=0.0, correct=True), A.Sample([2], "b", reward=1.0, correct=False)
    assert yes.is_correct(1.0) and not no.is_correct(1.0)
    assert A.Sample([3], "c", reward=0.5).is_correct(0.5) and not A.Sample([3], "c", reward=0.4).is_correct(0.5)
    groups = [[yes, yes], [yes, no], [no, no]]
    assert A.near_perfect(groups, tau=2) == [0] and A.near_perfect(groups, tau=1) == [0, 1]
    pef, exp, n = A.split_chunk([{"id": "x"}, {"id": "y"}, {"id": "z"}], ["x", "y", "z"], [[5], [6], [7]], groups,
                                n_pre=2, tau=1, drop_unsolved=True)
    assert [r["id"] for r in pef] == ["x", "y"] and exp == [] and n == [2, 1, 0]


def test_a_damaged_chunk_is_named_and_recomputed(tmp_path, capsys):
    """Both engines' chunk store: a truncated chunk file (outside damage) counts as still to do.
    The OpenRLHF copy of the store only checked that the file existed, so `assemble` crashed on it."""
    out = str(tmp_path / "ps")
    rows, texts, pids, samples = _chunk([[1, 1, 1, 1], [0, 1, 1, 0]])
    store = A.ShardStore(out, _settings(chunk_size=1), n_prompts=2)
    for c in (0, 1):
        pef, exp, n = A.split_chunk(rows[c:c + 1], texts[c:c + 1], pids[c:c + 1], samples[c:c + 1], n_pre=4,
                                    tau=4, drop_unsolved=False)
        for r in pef:
            r["ref_log_probs"] = [-0.1, -0.2]
        store.write_chunk(c, pef, exp, n)
    with open(store.chunk_path(1), "w") as f:
        f.write('{"chunk": 1, "pef": [')  # cut short
    assert store.todo() == [1]
    assert "chunk_000001.json is truncated or unreadable" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="still to sample"):
        store.assemble()


def test_summary_and_its_text(tmp_path):
    s = A.summarize([1, 0, 2, 0, 3], n_pef=2, n_exp=3, n_prompts=6,
                    settings={"n_pre": 4, "tau": 4, "drop_unsolved": True, "resample_anchor_responses": True,
                              "temperature": 0.7, "n_examples": 6})
    assert s["n_resample_failed"] == 1 and s["n_dropped_unsolved"] == 1 and "n_examples" not in s
    assert s["mean_correct_rate"] == pytest.approx((2 * 2 + 4 * 3) / 24)
    s["output_dir"] = "OUT"
    text = A.format_summary(s)
    assert "6 prompts x 4 samples (T=0.7), near-perfect = #correct >= 4" in text
    assert "1 unsolved dropped" in text and "1 near-perfect prompt(s) lost their anchor" in text
    assert "#correct histogram: 0:1 1:0 2:2 3:0 4:3" in text
    assert A.format_summary({"complete": False, "chunks_done": 1, "chunks_total": 3, "output_dir": "O"}) \
        .startswith("pre-sampling paused: 1/3 chunks")


def test_sampler_is_one_numpy_stream_per_epoch():
    """The sampler of both engines: epoch e is numpy's ``default_rng([seed, e])`` permutation."""
    items = list("abcdefg")
    cur = A.AnchorSampler(items, seed=5)
    want = [items[i] for i in np.random.default_rng([5, 0]).permutation(7)] + \
           [items[i] for i in np.random.default_rng([5, 1]).permutation(7)][:3]
    assert cur.draw(4) + cur.next(6) == want
    st = cur.state_dict()
    assert st == {"epoch": 1, "pos": 3, "seed": 5, "n": 7}
    again = A.AnchorSampler(items, seed=0)
    again.load_state_dict({k: v for k, v in st.items() if k != "n"})  # an OpenRLHF checkpoint of the old pool
    assert again.draw(2) == cur.draw(2)
    with pytest.raises(ValueError, match="covers 9 items"):
        again.load_state_dict({**st, "n": 9})
    with pytest.raises(ValueError, match="at least one item"):
        A.AnchorSampler([], seed=0)


def test_empty_d_pef_names_the_histogram_and_the_flag(tmp_path):
    (tmp_path / "d_pef.jsonl").write_text("")
    (tmp_path / "summary.json").write_text(json.dumps({"n_prompts": 5, "n_pre": 4, "tau": 4,
                                                       "correct_histogram": [2, 0, 3, 0, 0]}))
    with pytest.raises(A.EmptyAnchorError, match=r"'dph_js'.*#correct histogram 0:2 1:0 2:3.*"
                                                  r"presample\.tau=2: 3 prompt\(s\) would qualify"):
        A.read_pef(str(tmp_path), method="dph_js")
    with pytest.raises(A.EmptyAnchorError, match=r"`--presample.tau 2` with a fresh output directory"):
        A.read_pef(str(tmp_path / "d_pef.jsonl"), method="dph_js", tau_flag="--presample.tau")
    assert A.read_pef(str(tmp_path), allow_empty=True) == []


def test_anchor_temperature_must_match_the_rollout(tmp_path):
    (tmp_path / "d_pef.jsonl").write_text("")
    A.check_anchor_temperature(str(tmp_path / "d_pef.jsonl"), 0.7)  # no summary: nothing to check
    (tmp_path / "summary.json").write_text(json.dumps({"temperature": 1.0}))
    A.check_anchor_temperature(str(tmp_path), 1.0)
    with pytest.raises(ValueError, match="temperature 1.0 but --rollout.temperature is 0.7"):
        A.check_anchor_temperature(str(tmp_path / "d_pef.jsonl"), 0.7, "--rollout.temperature")
