"""The local engine: tiny model/tokenizer, sampler vs training forward, the trainer's losses
against independent recomputations, pre-sampling, resume, config errors, NaN handling."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from openrlhf_div.algorithms import get_method
from openrlhf_div.engines.local.config import ConfigError, load_config
from openrlhf_div.engines.local.generation import generate, pack_sequences, sequence_log_probs
from openrlhf_div.engines.local.presample import presample
from openrlhf_div.engines.local.models import load_model, save_model
from openrlhf_div.engines.local.tiny import build_tiny_model
from openrlhf_div.engines.local.trainer import NonFiniteLossError, Trainer, train
from openrlhf_div.tasks import get_task

from helpers import VOCAB, local_overrides as _overrides, write_copy_last_data  # the toy task test_copy_last

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_copy_last_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def presample_dir(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("presample")
    cfg = load_config(None, _overrides(data_dir, out / "run", extra=["presample.tau=1", "presample.chunk_size=16"]))
    s = presample(cfg, str(out / "ps"), progress=False)
    assert s["complete"] and s["n_pef"] > 0 and s["n_exp"] > 0
    return out / "ps"


# ---------------------------------------------------------------- tiny model + sampler
def test_tokenizer_roundtrip_and_atomic_save_load(tmp_path):
    model, tok = build_tiny_model(VOCAB + " ", seed=3)
    ids = tok("ab =c", add_special_tokens=False)["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(c) for c in "ab =c"]
    assert tok.decode(ids) == "ab =c"
    assert tok.convert_ids_to_tokens([tok.pad_token_id, tok.bos_token_id, tok.eos_token_id]) == ["<pad>", "<bos>", "<eos>"]
    save_model(model, tok, str(tmp_path / "m"))
    save_model(model, tok, str(tmp_path / "m"))  # replacing an existing directory works
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".")) == []  # no temp dirs left
    m2, t2 = load_model(str(tmp_path / "m"))
    assert t2("ab =c", add_special_tokens=False)["input_ids"] == ids
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k
    m3, _ = build_tiny_model(VOCAB + " ", seed=3)
    assert torch.equal(m3.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_sampler_log_probs_equal_training_forward_and_unpadded_reference():
    model, tok = build_tiny_model(VOCAB, seed=0)
    prompts = ["ab=", "a=", "abcde=", "fe="]
    T = 0.7
    out = generate(model, tok, prompts, n_samples=3, max_new_tokens=6, temperature=T,
                   generator=torch.Generator().manual_seed(5))
    assert out.input_ids.shape[0] == 12 and out.prompt_ids[3] == out.prompt_ids[5]
    lp = sequence_log_probs(model, out.input_ids, out.attention_mask, out.response_mask, temperature=T)
    torch.testing.assert_close(lp, out.log_probs, atol=1e-5, rtol=0)
    # independent: each sample alone (no padding at all), plain forward, log_softmax(logits / T)
    for i in range(len(out)):
        p, r = out.prompt_ids[i], out.response_ids[i]
        x = torch.tensor([p + r])
        with torch.no_grad():
            logits = model(input_ids=x).logits[0].float() / T
        ref = torch.log_softmax(logits, -1)[len(p) - 1:len(p) + len(r) - 1].gather(-1, torch.tensor(r)[:, None])[:, 0]
        torch.testing.assert_close(lp[i, :len(r)], ref, atol=1e-5, rtol=0)
        assert float(lp[i, len(r):].abs().sum()) == 0.0
        # stop rule: eos ends a response, otherwise max_new_tokens
        assert (r[-1] == tok.eos_token_id) == bool(out.finished[i])
        assert tok.eos_token_id not in r[:-1] and (out.finished[i] or len(r) == 6)
    # seeded reproducibility, and the packed layout round-trips
    again = generate(model, tok, prompts, n_samples=3, max_new_tokens=6, temperature=T,
                     generator=torch.Generator().manual_seed(5))
    assert again.response_ids == out.response_ids
    ids, attn, rm = pack_sequences(out.prompt_ids, out.response_ids, tok.pad_token_id)
    assert torch.equal(ids, out.input_ids) and torch.equal(attn, out.attention_mask) and torch.equal(rm, out.response_mask)
    # greedy (temperature 0): every token is the argmax of the training forward's logits
    gr = generate(model, tok, prompts, n_samples=2, max_new_tokens=6, temperature=0.0)
    assert gr.response_ids[0] == gr.response_ids[1]
    with torch.no_grad():
        logits = model(input_ids=gr.input_ids, attention_mask=gr.attention_mask,
                       position_ids=(gr.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits
    P = gr.input_ids.shape[1] - gr.response_mask.shape[1]
    am = logits[:, P - 1:-1].argmax(-1)
    assert bool(((am == gr.input_ids[:, P:]) | (gr.response_mask == 0)).all())
    _, ent = sequence_log_probs(model, out.input_ids, out.attention_mask, out.response_mask,
                                return_entropy=True, temperature=T)
    assert float(ent.max()) <= math.log(len(tok)) + 1e-5 and float(ent[out.response_mask.bool()].min()) > 0


# ---------------------------------------------------------------- the applied loss, by family
def _by_hand(name, m, on, an, n_on_tok, n_an_tok):
    """The method's loss written out from ALGORITHMS.md, without the library's loss code."""
    h = m.hparams
    lp, old, A, mask = on.log_probs, on.old_log_probs, on.advantages, on.mask
    r = torch.exp((lp - old).clamp(-20, 20))
    if name == "lad_js":
        z = (A / h["lad_eta"]).clamp(-20, 20)
        lx = (lp - old - z).clamp(-20, 20)
        x = torch.exp(lx)
        f = 0.5 * (x * lx - (x + 1) * torch.log((x + 1) / 2))
        per = torch.exp(z) * f
    else:
        l1, l2 = -A * r, -A * r.clamp(1 - h["eps_low"], 1 + h["eps_high"])
        per = torch.maximum(l1, l2)
        per = torch.where(A < 0, torch.minimum(per, -h["dual_clip"] * A), per)
    if name == "rkl":
        d = on.ref_log_probs - lp
        per = per + h["kl_coef"] * (torch.exp(d) - d - 1)
    total = (per * mask).sum() / n_on_tok
    if an is not None:
        lu = an.log_probs - an.ref_log_probs
        u = torch.exp(lu)
        f = u * lu - (u + 1) * torch.log((u + 1) / 2)
        total = total + h["anchor_eta"] * (f * an.mask).sum() / n_an_tok
    return total


@pytest.mark.parametrize("name", ["grpo", "dph_js", "ds_grpo", "lad_js", "rkl"])
def test_applied_loss_equals_independent_recomputation(name, data_dir, presample_dir, tmp_path):
    events = []
    extra = ["optim.ppo_epochs=2", "optim.micro_batch_size=6"]
    if name == "dph_js":
        extra.append(f"data.presample_dir={presample_dir}")
    cfg = load_config(None, _overrides(data_dir, tmp_path / "run", name, extra))
    tr = Trainer(cfg, hooks=[events.append])
    tr.train()
    m = get_method(name)
    needs = m.needs
    assert (tr.ref_model is not None) == needs.ref_log_probs == (name == "rkl")
    assert len({(e["step"], e["epoch"]) for e in events}) == 4
    base, _ = build_tiny_model(VOCAB, seed=cfg.seed)
    for e in events:
        on, an = e["online"], e["anchor"]
        # the anchor batch is used by the DPH method only, with the stored base log-probs
        assert (an is not None) == (len(e["anchors"]) > 0)
        assert an is None or name == "dph_js"
        assert (on.ref_log_probs is not None) == (name == "rkl")
        if an is not None:
            stored = {tuple(a.response_ids): a.ref_log_probs for a in e["anchors"]}
            for i, a in enumerate(e["anchors"]):
                n = len(a.response_ids)
                assert an.ref_log_probs[i, :n].tolist() == pytest.approx(stored[tuple(a.response_ids)], abs=0)
        # same tensors through the registry, recomputed from scratch
        clone = lambda x: None if x is None else x.detach().clone()
        from openrlhf_div.algorithms import AnchorInputs, LossInputs
        on2 = LossInputs(log_probs=clone(on.log_probs), old_log_probs=clone(on.old_log_probs),
                         advantages=clone(on.advantages), mask=clone(on.mask), correct=clone(on.correct),
                         ref_log_probs=clone(on.ref_log_probs), entropy=clone(on.entropy))
        an2 = None if an is None else AnchorInputs(clone(an.log_probs), clone(an.ref_log_probs), clone(an.mask))
        reg, _ = m.loss(online=on2, anchor=an2, num_online_tokens=e["num_online_tokens"],
                        num_anchor_tokens=e["num_anchor_tokens"], num_online_seqs=e["num_online_seqs"])
        assert float(reg) == pytest.approx(float(e["loss"]), rel=1e-6, abs=1e-7)
        hand = _by_hand(name, m, on2, an2, e["num_online_tokens"], e["num_anchor_tokens"])
        assert float(hand) == pytest.approx(float(e["loss"]), rel=1e-5, abs=1e-6)
        exp = e["experience"]
        assert e["num_online_tokens"] == float(exp.mask.sum())  # one mini-batch = the whole step
        if e["epoch"] == 0 and e["micro_batch"] == 0:
            # the behaviour policy: before the first update of a step, lp == old
            torch.testing.assert_close(on.log_probs.detach(), on.old_log_probs, atol=1e-5, rtol=0)
        if name == "rkl" and e["epoch"] == 0:
            ids, attn, rm = pack_sequences([exp.prompt_ids[i] for i in e["rows"]],
                                           [exp.response_ids[i] for i in e["rows"]], 0)
            with torch.no_grad():
                ref = sequence_log_probs(base, ids, attn, rm)
            torch.testing.assert_close(on.ref_log_probs[:, :ref.shape[1]], ref, atol=1e-5, rtol=0)
    # advantages: rewards from the task, GRPO normalisation, DS reshaping written out by hand
    exp = events[0]["experience"]
    task = get_task("test_copy_last")
    G = cfg.rollout.group_size
    R = exp.rewards.view(-1, G)
    grpo = ((R - R.mean(1, keepdim=True)) / (R.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    tok = tr.tokenizer
    for i, rid in enumerate(exp.response_ids):
        pid = exp.prompt_ids[i]
        label = tok.decode(pid)[-2]
        assert float(exp.rewards[i]) == task.reward(tok.decode(rid, skip_special_tokens=True), label)
    if name == "ds_grpo":
        c = exp.correct.float().view(-1, 1)
        want = (grpo - c * 0.01 * exp.old_log_probs + (1 - c) * 0.01 * exp.old_log_probs) * exp.mask
    elif name in ("grpo", "dph_js", "lad_js", "rkl"):
        want = grpo * exp.mask
    torch.testing.assert_close(exp.advantages, want, atol=1e-5, rtol=1e-5)
    # anchors: ceil(rows / ratio) per optimizer step; L_pef divides by the step's anchor tokens
    if name == "dph_js":
        per_step, tokens = {}, {}
        for e in events:
            key = (e["step"], e["epoch"])
            per_step[key] = per_step.get(key, 0) + len(e["anchors"])
            tokens[key] = tokens.get(key, 0.0) + (float(e["anchor"].mask.sum()) if e["anchor"] is not None else 0.0)
        assert set(per_step.values()) == {math.ceil(16 / 8)}
        for e in events:
            assert e["num_anchor_tokens"] == tokens[(e["step"], e["epoch"])] > 0


def test_dynamic_sampling_keeps_only_informative_groups(data_dir, tmp_path):
    events = []
    cfg = load_config(None, _overrides(data_dir, tmp_path / "run", "dapo", ["optim.steps=1"]))
    tr = Trainer(cfg, hooks=[events.append])
    tr.train()
    exp = events[0]["experience"]
    R = exp.rewards.view(-1, 4)
    assert bool((R.max(1).values > R.min(1).values).all())
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert row["kept_groups"] == R.shape[0] <= 4 and row["generation_rounds"] >= 1


# ---------------------------------------------------------------- pre-sampling
def test_presample_split_and_resume_is_byte_identical(data_dir, presample_dir, tmp_path, monkeypatch):
    cfg = load_config(None, _overrides(data_dir, tmp_path / "run", extra=["presample.tau=1", "presample.chunk_size=16"]))
    # D_pef content: a correct response, stored base log-probs = the training forward's
    base, tok = build_tiny_model(VOCAB, seed=cfg.seed)
    pef = [json.loads(x) for x in open(presample_dir / "d_pef.jsonl")]
    exp = [json.loads(x) for x in open(presample_dir / "d_exp.jsonl")]
    assert len(pef) + len(exp) == 40 and {r["id"] for r in pef}.isdisjoint({r["id"] for r in exp})
    task = get_task("test_copy_last")
    for r in pef[:5]:
        assert task.reward(r["response"], r["label"]) == 1.0 and r["n_correct"] >= 1
        ids, attn, rm = pack_sequences([r["prompt_ids"]], [r["response_ids"]], tok.pad_token_id)
        with torch.no_grad():
            lp = sequence_log_probs(base, ids, attn, rm)[0]
        torch.testing.assert_close(torch.tensor(r["ref_log_probs"]), lp, atol=1e-6, rtol=0)
    assert all(r["n_correct"] < 1 for r in exp)

    # interrupted mid-run (a crash inside chunk 1), then resumed
    import openrlhf_div.engines.local.presample as ps
    real = ps._process_chunk

    def crash(model, tokenizer, task, examples, chunk, *args, **kw):
        if chunk == 1:
            raise KeyboardInterrupt
        return real(model, tokenizer, task, examples, chunk, *args, **kw)

    monkeypatch.setattr(ps, "_process_chunk", crash)
    with pytest.raises(KeyboardInterrupt):
        presample(cfg, str(tmp_path / "ps"), progress=False)
    assert not (tmp_path / "ps" / "d_pef.jsonl").exists()
    monkeypatch.setattr(ps, "_process_chunk", real)
    part = presample(cfg, str(tmp_path / "ps"), max_new_chunks=1, progress=False)
    assert part["complete"] is False and part["chunks_done"] == 2
    s = presample(cfg, str(tmp_path / "ps"), progress=False)
    assert s["complete"]
    for f in ("d_pef.jsonl", "d_exp.jsonl", "summary.json"):
        a = (presample_dir / f).read_bytes()
        b = (tmp_path / "ps" / f).read_bytes()
        if f == "summary.json":
            a, b = (json.loads(x) for x in (a, b))
            a.pop("output_dir"), b.pop("output_dir"), a.pop("seconds", None), b.pop("seconds", None)
        assert a == b, f
    # different settings in the same directory: refused
    with pytest.raises(ValueError, match="n_pre"):
        presample(load_config(None, _overrides(data_dir, tmp_path / "run", extra=["presample.n_pre=4"])),
                  str(tmp_path / "ps"), progress=False)
    # drop_unsolved leaves the 0-correct prompts out of D_exp
    cfg2 = load_config(None, _overrides(data_dir, tmp_path / "run", extra=[
        "presample.tau=2", "presample.chunk_size=16", "presample.drop_unsolved=true"]))
    s2 = presample(cfg2, str(tmp_path / "ps2"), progress=False)
    exp2 = [json.loads(x) for x in open(tmp_path / "ps2" / "d_exp.jsonl")]
    assert all(r["n_correct"] == 1 for r in exp2) and s2["n_dropped_unsolved"] == s2["correct_histogram"][0]
    assert s2["n_pef"] + s2["n_exp"] + s2["n_dropped_unsolved"] == 40


def test_presample_resample_anchor_responses(data_dir, presample_dir, tmp_path):
    """The authors' anchor draw (seamoke/DPH-RL generate_sft): one fresh sample per near-perfect
    prompt, kept only if correct; the split itself is the same draw as without the option."""
    cfg = load_config(None, _overrides(data_dir, tmp_path / "run", extra=[
        "presample.tau=1", "presample.chunk_size=16", "presample.resample_anchor_responses=true"]))
    s = presample(cfg, str(tmp_path / "ps"), progress=False)
    plain = {r["id"]: r for r in map(json.loads, open(presample_dir / "d_pef.jsonl"))}
    fresh = [json.loads(x) for x in open(tmp_path / "ps" / "d_pef.jsonl")]
    assert (tmp_path / "ps" / "d_exp.jsonl").read_bytes() == (presample_dir / "d_exp.jsonl").read_bytes()
    assert {r["id"] for r in fresh} <= set(plain)
    assert len(fresh) + s["n_resample_failed"] == len(plain) and s["resample_anchor_responses"] is True
    assert s["n_resample_failed"] > 0  # with this tiny policy some fresh draws fail
    assert any(r["response_ids"] != plain[r["id"]]["response_ids"] for r in fresh)
    task = get_task("test_copy_last")
    base, tok = build_tiny_model(VOCAB, seed=cfg.seed)
    for r in fresh:
        assert task.reward(r["response"], r["label"]) == 1.0
        ids, attn, rm = pack_sequences([r["prompt_ids"]], [r["response_ids"]], tok.pad_token_id)
        with torch.no_grad():
            lp = sequence_log_probs(base, ids, attn, rm)[0]
        torch.testing.assert_close(torch.tensor(r["ref_log_probs"]), lp, atol=1e-6, rtol=0)


def test_authors_mode_microbatch_share_and_micro_batch_token_mean(data_dir, presample_dir, tmp_path):
    """The DPH-RL authors' aggregation in the local engine: per optimizer step the micro-batch
    losses add up to the mean over 2-sequence groups of their token-means, the anchor groups
    weighted eta x #anchors / #online rows (written out here from the per-token losses)."""
    from openrlhf_div.algorithms.losses import dph_anchor_loss, ppo_clip_loss

    eta = 0.5
    events = []
    cfg = load_config(None, _overrides(data_dir, tmp_path / "run", "dph_f", [
        f"data.presample_dir={presample_dir}", "optim.micro_batch_size=4", "optim.mini_batches=2",
        "optim.anchor_ratio=2", f"method.anchor_eta={eta}", "method.anchor_weighting=microbatch_share",
        "method.aggregation=micro-batch-token-mean", "method.micro_batch_seqs=2"]))
    Trainer(cfg, hooks=[events.append]).train()
    m = get_method("dph_f", anchor_eta=eta)
    h = m.hparams
    steps = {}
    for e in events:
        steps.setdefault((e["step"], e["epoch"], e["mini_batch"]), []).append(e)
    assert len(steps) == 4  # 2 RL steps x 2 mini-batches
    for evs in steps.values():
        n_on, n_an = evs[0]["num_online_seqs"], evs[0]["num_anchor_seqs"]
        assert (n_on, n_an) == (8.0, 4.0)
        expected = 0.0
        for e in evs:
            on, an = e["online"], e["anchor"]
            parts = [(ppo_clip_loss(on.log_probs, on.old_log_probs, on.advantages, on.mask, h["eps_low"],
                                    h["eps_high"], h["dual_clip"]), on.mask, 1.0 / n_on)]
            if an is not None:
                assert an.log_probs.shape[0] % 2 == 0  # anchors travel in whole groups of 2
                parts.append((dph_anchor_loss(an.log_probs, an.ref_log_probs, an.mask, "forward_kl"), an.mask,
                              eta * (n_an / n_on) / n_an))
            for per_tok, mask, w in parts:
                for i in range(0, per_tok.shape[0], 2):
                    expected += 2 * w * float((per_tok[i:i + 2] * mask[i:i + 2]).sum() / mask[i:i + 2].sum())
        assert sum(float(e["loss"]) for e in evs) == pytest.approx(expected, rel=1e-5, abs=1e-7)
    with pytest.raises(ConfigError, match="must be a multiple of it"):
        load_config(None, _overrides(data_dir, tmp_path / "r2", "dph_f", [
            "optim.micro_batch_size=3", "method.aggregation=micro-batch-token-mean"]))


def test_flowrl_authors_log_z_head_trains_the_trunk(data_dir, tmp_path):
    """log_z_head: authors (Xuekai-Zhu/FlowRL ProjZModule, not detached): the log Z part of the
    loss reaches the policy's weights; the library's small head detaches them."""
    from openrlhf_div.algorithms.authors import AuthorsLogZHead
    from openrlhf_div.algorithms.heads import LogZHead

    grads = {}
    for kind in ("authors", "small_detached"):
        cfg = load_config(None, _overrides(data_dir, tmp_path / kind, "flowrl", [
            "optim.steps=1", f"method.log_z_head={kind}"]))
        tr = Trainer(cfg)
        assert isinstance(tr.log_z_head, AuthorsLogZHead if kind == "authors" else LogZHead)
        hidden = torch.randn(2, tr.model.config.hidden_size, requires_grad=True)
        tr.log_z_head(hidden).sum().backward()
        grads[kind] = hidden.grad
        tr.train()
    assert grads["authors"] is not None and float(grads["authors"].abs().sum()) > 0
    assert grads["small_detached"] is None


# ---------------------------------------------------------------- resume, NaN, config errors
def _first_losses(events):
    out = {}
    for e in events:
        out.setdefault(e["step"], float(e["loss"]))
    return out


def test_resume_reproduces_the_uninterrupted_run(data_dir, presample_dir, tmp_path):
    extra = [f"data.presample_dir={presample_dir}", "optim.ppo_epochs=2", "optim.mini_batches=2",
             "optim.micro_batch_size=4"]
    ev_a = []
    train(overrides=_overrides(data_dir, tmp_path / "a", "dph_js", extra + ["optim.steps=3"]), hooks=[ev_a.append])
    ev_b = []
    train(overrides=_overrides(data_dir, tmp_path / "b", "dph_js", extra + ["optim.steps=2"]), hooks=[ev_b.append])
    ev_c = []
    train(resume=str(tmp_path / "b"), overrides=["optim.steps=3"], hooks=[ev_c.append])
    la, lb, lc = _first_losses(ev_a), _first_losses(ev_b), _first_losses(ev_c)
    assert lb == {1: la[1], 2: la[2]}
    assert list(lc) == [3] and lc[3] == la[3]  # exact, not approximate
    # same next batch, and every micro-batch loss of the resumed step identical
    a3 = [e for e in ev_a if e["step"] == 3]
    assert [e["experience"].response_ids for e in a3][:1] == [ev_c[0]["experience"].response_ids]
    assert [float(e["loss"]) for e in a3] == [float(e["loss"]) for e in ev_c]
    ma = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    mb = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert [m["step"] for m in mb] == [1, 2, 3] and mb[2]["loss"] == ma[2]["loss"]
    # the anchor_samples metric is the rollout step's D_pef count (the Ray engine's rollout/num_anchor_samples),
    # not a per-micro-batch mean (before: 1.0 here, with 2 anchors a step over 2 mini-batches x 2 micro-batches)
    drawn = {}
    for e in ev_a:
        if e["epoch"] == 0:
            drawn[e["step"]] = drawn.get(e["step"], 0) + len(e["anchors"])
    assert [m["anchor_samples"] for m in ma] == [float(drawn[s]) for s in (1, 2, 3)] and drawn[1] == 2


def test_nan_loss_stops_with_step_and_keeps_last_good_checkpoint(data_dir, tmp_path):
    cfg = load_config(None, _overrides(data_dir, tmp_path / "run", "grpo", ["optim.steps=5", "checkpoint.every=1"]))
    snap = {}

    def hook(e):
        if e["step"] == 3 and "w" not in snap:
            snap["w"] = {k: v.detach().clone() for k, v in e["trainer"].model.state_dict().items()}

    tr = Trainer(cfg, hooks=[hook])
    real = tr.method.loss

    def poisoned(**kw):
        loss, met = real(**kw)
        return (loss * float("nan") if tr.step + 1 == 3 else loss), met

    tr.method.loss = poisoned
    with pytest.raises(NonFiniteLossError, match=r"at step 3 .*step_000002"):
        tr.train()
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_000002"
    assert not (ck / "step_000003").exists()
    m, _ = load_model(str(ck / "step_000002" / "model"))
    for k, v in m.state_dict().items():
        assert torch.equal(v, snap["w"][k]), k
    # and the run continues from there
    out = train(resume=str(tmp_path / "run"), overrides=["optim.steps=3"])
    assert out["metrics"]["step"] == 3


def test_unknown_config_keys_name_the_key_and_suggestions(tmp_path):
    with pytest.raises(ConfigError, match=r"'rollout\.temprature'.*'rollout\.temperature'"):
        load_config(None, ["task=test_copy_last", "rollout.temprature=0.5"])
    with pytest.raises(ConfigError, match=r"'optim'"):
        load_config(None, ["task=test_copy_last", "optimm.steps=3"])
    with pytest.raises(ConfigError, match=r"anchor_et.*'anchor_eta'"):
        load_config(None, ["task=test_copy_last", "method.name=dph_js", "method.anchor_et=0.1"])
    p = tmp_path / "c.yaml"
    p.write_text("task: test_copy_last\nrollout:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match=r"'rollout\.group_sise'.*'rollout\.group_size'"):
        load_config(str(p))
    cfg = load_config(None,
                      ["task=test_copy_last", "method.name=dph_js", "method.anchor_eta=0.05", "eval.k=[1,2]"])
    assert cfg.build_method().anchor_weight == 0.05 and cfg.eval.k == [1, 2]
    # switching method drops the old method's hyperparameters instead of failing on them
    p.write_text("task: test_copy_last\nmethod: {name: dph_js, anchor_eta: 0.1}\n")
    assert load_config(str(p), ["method.name=grpo"]).method == {"name": "grpo"}
    from openrlhf_div.cli.main import main
    assert main(["train", "--config", str(p), "rollout.temprature=1"]) == 2


def test_every_registered_method_gets_what_it_needs_and_its_own_loss(data_dir, presample_dir, tmp_path):
    """One step of every method: the engine passes exactly what ``method.needs`` asks for
    (reference log-probs, entropy, log Z, anchors) and applies the registry's loss."""
    from openrlhf_div.algorithms import AnchorInputs, LossInputs, list_methods

    clone = lambda x: None if x is None else x.detach().clone()
    for name in list_methods():
        events = []
        m = get_method(name)
        extra = ["optim.steps=1", "rollout.prompts_per_step=2", "optim.micro_batch_size=4"]
        if m.needs.anchor_batch:
            extra.append(f"data.presample_dir={presample_dir}")
        cfg = load_config(None, _overrides(data_dir, tmp_path / name, name, extra))
        tr = Trainer(cfg, hooks=[events.append])
        tr.train_step()
        assert events, name
        assert (tr.ref_model is not None) == m.needs.ref_log_probs, name
        assert (tr.log_z_head is not None) == m.needs.prompt_hidden, name
        for e in events:
            on, an = e["online"], e["anchor"]
            assert (on.ref_log_probs is not None) == m.needs.ref_log_probs, name
            assert (on.entropy is not None) == m.needs.entropy, name
            assert (on.log_z is not None) == m.needs.prompt_hidden, name
            assert an is None or m.needs.anchor_batch, name
            g = torch.Generator().set_state(e["train_rng_state"])
            on2 = LossInputs(log_probs=clone(on.log_probs), old_log_probs=clone(on.old_log_probs),
                             advantages=clone(on.advantages), mask=clone(on.mask), correct=clone(on.correct),
                             ref_log_probs=clone(on.ref_log_probs), entropy=clone(on.entropy),
                             log_z=clone(on.log_z), generator=g)
            an2 = None if an is None else AnchorInputs(clone(an.log_probs), clone(an.ref_log_probs), clone(an.mask))
            reg, _ = get_method(name).loss(online=on2, anchor=an2, num_online_tokens=e["num_online_tokens"],
                                           num_anchor_tokens=e["num_anchor_tokens"],
                                           num_online_seqs=e["num_online_seqs"])
            assert torch.isfinite(e["loss"]), name
            assert float(reg) == pytest.approx(float(e["loss"]), rel=1e-6, abs=1e-7), name
        if m.needs.anchor_batch:
            assert any(e["anchor"] is not None for e in events), name


def test_ctrl_c_finishes_the_step_and_checkpoints(data_dir, tmp_path):
    cfg = load_config(None, _overrides(data_dir, tmp_path / "run", "grpo", ["optim.steps=5"]))

    def hook(e):
        if e["step"] == 2 and not e["trainer"].interrupt.requested:
            e["trainer"].interrupt.handle(None, None)  # what SIGINT does

    tr = Trainer(cfg, hooks=[hook])
    with pytest.raises(KeyboardInterrupt):
        tr.train()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert [json.loads(x)["step"] for x in open(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_lean_decoder_matches_hf_cache_path(arch):
    from openrlhf_div.engines.local.fastgen import HFDecoder, LlamaLikeDecoder, make_decoder

    model, tok = build_tiny_model(VOCAB, seed=1)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    assert isinstance(make_decoder(model, 2, 8), LlamaLikeDecoder)
    assert isinstance(make_decoder(model, 2, 8, fast=False), HFDecoder)
    prompts = ["ab=", "abcdef=", "f="]
    kw = dict(n_samples=4, max_new_tokens=7, temperature=1.3)
    a = generate(model, tok, prompts, generator=torch.Generator().manual_seed(9), fast=False, **kw)
    b = generate(model, tok, prompts, generator=torch.Generator().manual_seed(9), fast=True, **kw)
    assert a.response_ids == b.response_ids
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)
    lp = sequence_log_probs(model, b.input_ids, b.attention_mask, b.response_mask, temperature=1.3)
    torch.testing.assert_close(lp.detach(), b.log_probs, atol=1e-5, rtol=0)
