"""The Megatron engine on CPU (gloo, megatron-core 0.16 through cpu_compat) against Hugging Face.

A tiny Qwen2 (untied, qkv bias) and a tiny Llama (tied embeddings, GQA) are loaded from their HF
state dicts into Megatron ``GPTModel`` stages under TP=2, PP=2, DP=2 and TP=2 x PP=2 layouts;
every check compares with an independent computation on the HF model:

* old log-probs / entropies (left and right padding, temperature) equal HF's;
* the exported HF weights equal the loaded ones exactly;
* one SGD step (lr 1, no clipping: the update *is* the gradient) on two micro-batches of a DPH-JS
  step (online + anchor rows) gives HF's weights after the same registry loss, and the reported
  loss and grad norm match;
* Adam + Megatron's distributed optimiser: two steps match torch AdamW; a checkpoint after step 1
  resumed in a fresh engine reproduces step 2 exactly, with the scheduler and client state.
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from openrlhf_div.algorithms import get_method  # noqa: E402
from openrlhf_div.algorithms.registry import AnchorInputs, LossInputs  # noqa: E402
from openrlhf_div.engines.megatron.config import MegatronConfig  # noqa: E402
from openrlhf_div.engines.megatron.loss import MicroBatch  # noqa: E402
from openrlhf_div.compat.mcore_cpu import run_multiprocess  # noqa: E402

pytestmark = pytest.mark.slow
TEMP = 0.9
V = 50
SPLITS = [[0, 1, 2], [3, 4, 5]]


def tiny(kind):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if kind == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=False, rope_theta=10000.0, **common)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(tie_word_embeddings=True, **common)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return cfg, model.eval()


def data():
    g = torch.Generator().manual_seed(5)
    B, L = 6, 10
    seq = torch.randint(0, V, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    am[0, 7:] = 0          # right padding
    am[2, :2] = 0          # left padding
    act = torch.zeros(B, L - 1)
    act[:, 4:] = 1
    act[0, 6:] = 0
    act[4, 4:6] = 0
    return dict(sequences=seq, attention_mask=am, action_mask=act,
                old_log_probs=-torch.rand(B, L - 1, generator=g) * 4 * act,
                advantages=torch.randn(B, generator=g)[:, None] * act,
                is_anchor=torch.tensor([False, True, False, False, False, True]),
                anchor_ref_log_probs=-torch.rand(B, L - 1, generator=g) * 4 * act,
                correct=torch.rand(B, generator=g) > 0.5)


def micro(d, rows):
    return MicroBatch(**{k: v[rows] for k, v in d.items()})


def _worker(rank, world, spec):
    from openrlhf_div.engines.megatron.engine import MegatronEngine, OptimSettings, init_megatron_parallel

    mcfg = MegatronConfig(tp=spec["tp"], pp=spec["pp"], bf16=False, vocab_divisor=8,
                          distributed_optimizer=spec.get("dist_opt", False))
    init_megatron_parallel(mcfg, seed=1)
    cfg, model = tiny(spec["model"])
    optim = OptimSettings(optimizer=spec.get("optimizer", "sgd"), lr=spec.get("lr", 1.0), eps=1e-3,
                          betas=(0.9, 0.95), max_norm=1e9, warmup_ratio=0.0, lr_scheduler="constant", max_steps=10)

    def engine():
        return MegatronEngine(mcfg, hf_config=cfg, hf_weights=model.state_dict(), train=True, optim=optim,
                              method=get_method(spec["method"]), temperature=TEMP)

    eng = engine()
    d = data()
    if not get_method(spec["method"]).needs.anchor_batch:
        d["is_anchor"] = torch.zeros(6, dtype=torch.bool)
    out = {}
    lp, h = eng.forward_log_probs(d["sequences"], d["attention_mask"], d["action_mask"], need_entropy=True)
    out.update(lp=lp, h=h, loaded=eng.hf_state_dict())
    dp = world // (spec["tp"] * spec["pp"])
    dp_rank = rank // (spec["tp"] * spec["pp"])
    batches = [micro(d, s) for s in SPLITS] if dp == 1 else [micro(d, SPLITS[dp_rank])]
    out["metrics"] = [eng.train_step(batches)]
    if spec.get("ckpt"):
        eng.save_checkpoint(spec["ckpt"], "step1", client_state={"global_step": 1, "data": [3, 4]}, max_num=2)
    out["metrics"].append(eng.train_step(batches) if spec.get("steps", 1) > 1 else None)
    out["after"] = eng.hf_state_dict()
    if spec.get("ckpt"):
        eng2 = engine()
        client = eng2.load_checkpoint(spec["ckpt"])
        out["client"] = client
        out["sched_steps"] = eng2.scheduler.num_steps
        out["metrics_resumed"] = eng2.train_step(batches)
        out["after_resumed"] = eng2.hf_state_dict()
    if spec.get("authors"):  # a fresh engine, the authors' layout: this replica's micro-batches and factors
        eng_a = MegatronEngine(mcfg, hf_config=cfg, hf_weights=model.state_dict(), train=True, optim=optim,
                               method=get_method("dph_f", **AUTHORS_OVERRIDES), temperature=TEMP)
        mbs = []
        for rows, coef in spec["authors"][dp_rank]:
            mb = micro(d, rows)
            mb.authors_coef = coef
            mbs.append(mb)
        eng_a.train_step(mbs)
        out["after_authors"] = eng_a.hf_state_dict()
    return out if rank == 0 else {k: out[k] for k in ("lp", "metrics")}


def hf_forward(model, d):
    am = d["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(d["sequences"], attention_mask=am, position_ids=pos).logits.float() / TEMP
    logp = torch.log_softmax(logits[:, :-1], -1)
    lp = logp.gather(-1, d["sequences"][:, 1:, None])[..., 0]
    h = -(logp.exp() * logp).sum(-1)
    return lp, h


def reference(kind, method_name, optimizer="sgd", steps=1, lr=1.0):
    cfg, model = tiny(kind)
    d = data()
    method = get_method(method_name)
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.0))
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        lp, h = hf_forward(model, d)
        a = d["is_anchor"] if method.needs.anchor_batch else torch.zeros(6, dtype=torch.bool)
        on = ~a
        online = LossInputs(log_probs=lp[on], old_log_probs=d["old_log_probs"][on], advantages=d["advantages"][on],
                            mask=d["action_mask"][on], correct=d["correct"][on], entropy=h[on])
        anc = (AnchorInputs(log_probs=lp[a], ref_log_probs=d["anchor_ref_log_probs"][a], mask=d["action_mask"][a])
               if a.any() else None)
        loss, _ = method.loss(online=online, anchor=anc)
        loss.backward()
        norms.append(float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))))
        losses.append(float(loss.detach()))
        opt.step()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_forward_and_export(res, kind):
    cfg, model = tiny(kind)
    d = data()
    with torch.no_grad():
        lp, h = hf_forward(model, d)
    act = d["action_mask"]
    for r in res:
        torch.testing.assert_close(r["lp"], lp * act, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(res[0]["h"], h * act, rtol=1e-5, atol=2e-6)
    hf = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(res[0]["loaded"]) == sorted(hf)
    for k, v in hf.items():
        assert torch.equal(res[0]["loaded"][k], v), k


def _check_step(res, kind, method, **kw):
    losses, norms, sd = reference(kind, method, **kw)
    m = res[0]["metrics"][0]
    assert m["loss"] == pytest.approx(losses[0], rel=1e-5)
    assert m["actor_grad_norm"] == pytest.approx(norms[0], rel=1e-4)
    for r in res:   # every rank reports the same metrics
        assert r["metrics"][0]["loss"] == pytest.approx(m["loss"], rel=1e-9)
    after = res[0]["after"]
    for k, v in after.items():
        torch.testing.assert_close(v, sd[k], rtol=1e-5, atol=1e-6, msg=k)
    moved = sum(float((after[k] - tiny(kind)[1].state_dict()[k]).abs().sum()) for k in after)
    assert moved > 0


@pytest.mark.parametrize("kind,tp,pp,world", [("qwen2", 2, 1, 2), ("llama", 2, 1, 2), ("llama", 1, 2, 2),
                                              ("qwen2", 1, 1, 2)])
def test_layouts_match_hf(kind, tp, pp, world):
    """TP=2, PP=2 (tied embeddings across stages) and DP=2 (data split across replicas); at DP=2
    also the authors' layout (:func:`_check_authors_step`)."""
    dp2 = (tp, pp, world) == (1, 1, 2)
    res = run_multiprocess(_worker, world_size=world,
                           args=(dict(model=kind, tp=tp, pp=pp, method="dph_js",
                                      **({"authors": AUTHORS_MBS} if dp2 else {})),), timeout=120)
    _check_forward_and_export(res, kind)
    _check_step(res, kind, "dph_js")
    if dp2:
        _check_authors_step(res, kind)


# two data-parallel replicas, each with two of the authors' micro-batches (one kind each)
AUTHORS_MBS = {0: [([0, 2], 0.5), ([4], 0.5)], 1: [([3], 0.5), ([1, 5], 0.25)]}
AUTHORS_OVERRIDES = dict(anchor_eta=0.3, anchor_weighting="microbatch_share", aggregation="micro-batch-token-mean")


def _check_authors_step(res, kind):
    """The authors' update loop on the real Megatron engine (DP 2, SGD lr 1): the step's gradient
    is the replicas' average of sum(coef x token-mean x (eta for anchors)) over their micro-batches
    (written out here on the HF model, not through Method.loss)."""
    from openrlhf_div.algorithms.losses import dph_anchor_loss, ppo_clip_loss

    cfg, model = tiny(kind)
    d = data()
    h = get_method("dph_f", **AUTHORS_OVERRIDES).hparams
    lp, _ = hf_forward(model, d)
    total = 0.0
    for mbs in AUTHORS_MBS.values():
        for rows, coef in mbs:
            m = d["action_mask"][rows]
            if bool(d["is_anchor"][rows].all()):
                per_tok, w = dph_anchor_loss(lp[rows], d["anchor_ref_log_probs"][rows], m, "forward_kl"), 0.3
            else:
                assert not bool(d["is_anchor"][rows].any())
                per_tok = ppo_clip_loss(lp[rows], d["old_log_probs"][rows], d["advantages"][rows], m,
                                        h["eps_low"], h["eps_high"], h["dual_clip"])
                w = 1.0
            total = total + coef * w * (per_tok * m).sum() / m.sum()
    (total / len(AUTHORS_MBS)).backward()  # the data-parallel average (the authors' FSDP)
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    want = model.state_dict()
    for k, v in res[0]["after_authors"].items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_tp2_pp2_entropy_method():
    res = run_multiprocess(_worker, world_size=4,
                           args=(dict(model="qwen2", tp=2, pp=2, method="entropy_bonus"),), timeout=180)
    _check_forward_and_export(res, "qwen2")
    _check_step(res, "qwen2", "entropy_bonus")


def test_adam_distributed_optimizer_and_checkpoint_resume(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    spec = dict(model="qwen2", tp=2, pp=1, method="dph_f", optimizer="adam", lr=1e-2, dist_opt=True, steps=2,
                ckpt=ckpt)
    res = run_multiprocess(_worker, world_size=2, args=(spec,), timeout=120)
    r = res[0]
    losses, norms, sd = reference("qwen2", "dph_f", optimizer="adam", steps=2, lr=1e-2)
    assert r["metrics"][0]["loss"] == pytest.approx(losses[0], rel=1e-5)
    assert r["metrics"][1]["loss"] == pytest.approx(losses[1], rel=1e-5)
    for k, v in r["after"].items():
        torch.testing.assert_close(v, sd[k], rtol=1e-4, atol=1e-6, msg=k)
    # resume from step 1 in a fresh engine: step 2 is reproduced exactly
    assert r["client"] == {"global_step": 1, "data": [3, 4]}
    assert r["sched_steps"] == 1
    assert r["metrics_resumed"]["loss"] == pytest.approx(r["metrics"][1]["loss"], rel=1e-7)
    for k, v in r["after"].items():
        torch.testing.assert_close(r["after_resumed"][k], v, rtol=0, atol=1e-7, msg=k)
    assert open(os.path.join(ckpt, "latest")).read().strip() == "step1"


def _resume_worker(rank, world, spec):
    """Load a checkpoint under this process group's layout, then take one more Adam step."""
    from openrlhf_div.engines.megatron.engine import MegatronEngine, OptimSettings, init_megatron_parallel

    mcfg = MegatronConfig(tp=spec["tp"], pp=spec["pp"], bf16=False, vocab_divisor=8, distributed_optimizer=True)
    init_megatron_parallel(mcfg, seed=1)
    cfg, model = tiny(spec["model"])
    optim = OptimSettings(optimizer="adam", lr=spec["lr"], eps=1e-3, betas=(0.9, 0.95), max_norm=1e9,
                          warmup_ratio=0.0, lr_scheduler="constant", max_steps=10)
    with torch.no_grad():      # start from other weights: everything must come from the checkpoint
        for p in model.parameters():
            p.mul_(0.5)
    eng = MegatronEngine(mcfg, hf_config=cfg, hf_weights=model.state_dict(), train=True, optim=optim,
                         method=get_method(spec["method"]), temperature=TEMP)
    client = eng.load_checkpoint(spec["ckpt"])
    d = data()
    dp = world // (spec["tp"] * spec["pp"])
    dp_rank = rank // (spec["tp"] * spec["pp"])
    batches = [micro(d, s) for s in SPLITS] if dp == 1 else [micro(d, SPLITS[dp_rank])]
    loaded = eng.hf_state_dict()
    metrics = eng.train_step(batches)
    return {"client": client, "loaded": loaded, "metrics": metrics, "after": eng.hf_state_dict(),
            "sched_steps": eng.scheduler.num_steps}


@pytest.mark.parametrize("tp,pp,world", [(1, 1, 1), (1, 2, 2)])
def test_checkpoint_resumes_under_another_layout(tmp_path, tp, pp, world):
    """Saved at TP=2 (megatron-core dist_checkpointing, distributed optimiser), resumed at TP=1 /
    PP=2: the weights, Adam moments and step counter come back, so step 2 equals HF AdamW's."""
    ckpt = str(tmp_path / "ckpt")
    spec = dict(model="qwen2", tp=2, pp=1, method="dph_f", optimizer="adam", lr=1e-2, dist_opt=True, steps=1,
                ckpt=ckpt)
    run_multiprocess(_worker, world_size=2, args=(spec,), timeout=120)
    res = run_multiprocess(_resume_worker, world_size=world,
                           args=(dict(model="qwen2", tp=tp, pp=pp, method="dph_f", lr=1e-2, ckpt=ckpt),),
                           timeout=120)
    r = res[0]
    losses, norms, sd1 = reference("qwen2", "dph_f", optimizer="adam", steps=1, lr=1e-2)
    _, _, sd2 = reference("qwen2", "dph_f", optimizer="adam", steps=2, lr=1e-2)
    assert r["client"] == {"global_step": 1, "data": [3, 4]} and r["sched_steps"] == 2
    for k, v in sd1.items():
        torch.testing.assert_close(r["loaded"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    for k, v in sd2.items():     # Adam's second step needs the first step's moments and step count
        torch.testing.assert_close(r["after"][k], v, rtol=1e-4, atol=1e-6, msg=k)
