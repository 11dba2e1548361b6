"""The Megatron policy actor (no Ray: the plain class in 2 gloo processes, TP=2) driven through the
methods OpenRLHF's controller calls, against Hugging Face + the registry on the same data:
forward (old log-probs), append + fit (one Adam step over online and DPH anchor rows), checkpoint
save / resume with client state, HF export (save_model), offload / reload for colocation."""
import os
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("megatron.core")

from openrlhf_div.algorithms import get_method  # noqa: E402
from openrlhf_div.algorithms.registry import AnchorInputs, LossInputs  # noqa: E402
from openrlhf_div.engines.megatron import actor_class_for, reference_class_for, uses_megatron  # noqa: E402
from openrlhf_div.engines.contract import rows_from_experience  # noqa: E402
from openrlhf_div.engines.megatron.actor import collate_rows, resolve_method  # noqa: E402
from openrlhf_div.compat.mcore_cpu import run_multiprocess  # noqa: E402

pytestmark = pytest.mark.slow
V, TEMP, LR = 40, 0.8, 1e-2


def tiny_dir(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    m.save_pretrained(path)
    return m.eval()


def make_args(tmp, load=False):
    return NS(
        megatron=NS(tp=2, pp=1, bf16=False, vocab_divisor=8, distributed_optimizer=True),
        div=NS(method="dph_js", actor_backend="megatron", hparams=["anchor_eta=0.5"]),
        train=NS(seed=3, micro_batch_size=2, batch_size=6, max_epochs=1, colocate_all=False, async_enable=False),
        actor=NS(optim="adam", adam=NS(lr=LR, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.0), max_norm=1e9,
                 lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.1),
        rollout=NS(temperature=TEMP), vllm=NS(sync_backend="nccl"),
        ckpt=NS(path=os.path.join(tmp, "ckpt"), load_enable=load, max_num=2, save_hf=False, disable_ds=False,
                output_dir=os.path.join(tmp, "hf_out")),
        ds=NS(ring_attn_size=1, packing_samples=False, tensor_parallel_size=1))


def experiences():
    """Two OpenRLHF 0.11.2-style experiences (right-padded, action_mask over all L-1 targets)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(7)
    out = []
    for L, anchor in ((9, [False, True, False]), (11, [False, False, True])):
        seq = torch.randint(0, V, (3, L), generator=g)
        am = torch.ones(3, L, dtype=torch.long)
        am[0, L - 2:] = 0
        act = torch.zeros(3, L - 1)
        act[:, 3:] = 1
        act[0, L - 3:] = 0
        # the DeepSpeed path's contract: info["div_anchor"] per row, stored D_pef base log-probs
        # in base_action_log_probs on anchor rows
        exp = Experience(sequences=seq, attention_mask=am, action_mask=act,
                         action_log_probs=-torch.rand(3, L - 1, generator=g) * 3 * act,
                         base_action_log_probs=-torch.rand(3, L - 1, generator=g) * 3 * act,
                         advantages=torch.randn(3, 1, generator=g) * act,
                         info={"reward": torch.tensor([1.0, 0.0, 1.0]),
                               "div_anchor": [torch.tensor(float(a)) for a in anchor]})
        out.append(exp)
    return out


def _worker(rank, world, tmp):
    from openrlhf_div.engines.megatron.actor import MegatronPolicyActor, MegatronReferenceActor

    out = {}
    a = MegatronPolicyActor(world, rank, "127.0.0.1", None)
    a.init_model_from_pretrained(NS(args=make_args(tmp)), os.path.join(tmp, "hf"), max_steps=5)
    exps = experiences()
    # the controller's batched dispatch: forward per experience
    out["lp"] = a.execute_batch("forward", dict(sequences=[e.sequences for e in exps],
                                                attention_mask=[e.attention_mask for e in exps],
                                                action_mask=[e.action_mask for e in exps]), 0, 2)
    ref = MegatronReferenceActor(world, rank, "127.0.0.1", None)
    ref.init_model_from_pretrained(NS(args=make_args(tmp)), os.path.join(tmp, "hf"))
    out["ref_lp"] = [ref.forward(e.sequences, e.action_mask, e.attention_mask) for e in exps]
    a.execute_batch("append", dict(experience=exps), 0, 2)
    out["status"] = a.fit()
    a.save_checkpoint("global_step1", client_states={"global_step": 1, "total_consumed_prompts": 6})
    a.save_model()
    out["after"] = a.engine.hf_state_dict()
    lp_before = a.forward(exps[0].sequences, exps[0].action_mask, exps[0].attention_mask)
    freed = a.engine.offload()
    out["offloaded_bytes"] = freed
    out["param_storage_while_offloaded"] = a.engine.gpt.output_layer.weight.untyped_storage().nbytes()
    out["grad_storage_while_offloaded"] = a.engine.model.buffers[0].grad_data.untyped_storage().nbytes()
    out["lp_offloaded_equal"] = bool(torch.equal(lp_before, a.forward(exps[0].sequences, exps[0].action_mask,
                                                                      exps[0].attention_mask)))
    a.reload_states()
    out["lp_reloaded_equal"] = bool(torch.equal(lp_before, a.forward(exps[0].sequences, exps[0].action_mask,
                                                                     exps[0].attention_mask)))
    # resume in a fresh actor
    b = MegatronPolicyActor(world, rank, "127.0.0.1", None)
    b.init_model_from_pretrained(NS(args=make_args(tmp, load=True)), os.path.join(tmp, "hf"), max_steps=5)
    out["states"] = b.get_checkpoint_states()
    out["resumed"] = b.engine.hf_state_dict()
    return out


def _reference(model, steps=1):
    """HF + registry: AdamW steps over all 6 rows (token-mean over the step's global counts);
    returns the last step's loss and the weights after each step."""
    method = get_method("dph_js", anchor_eta=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.0)
    rows = [r for e in experiences() for r in rows_from_experience(e, method)]
    mb = collate_rows(rows)
    am = mb.attention_mask
    weights = []
    for _ in range(steps):
        logits = model(mb.sequences, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
        logp = torch.log_softmax(logits.float()[:, :-1] / TEMP, -1)
        lp = logp.gather(-1, mb.sequences[:, 1:, None])[..., 0]
        a = mb.is_anchor
        loss, metrics = method.loss(
            online=LossInputs(log_probs=lp[~a], old_log_probs=mb.old_log_probs[~a], advantages=mb.advantages[~a],
                              mask=mb.action_mask[~a]),
            anchor=AnchorInputs(log_probs=lp[a], ref_log_probs=mb.anchor_ref_log_probs[a], mask=mb.action_mask[a]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return float(loss.detach()), (weights[0] if steps == 1 else weights)


def hf_log_probs(model, exp):
    am = exp.attention_mask
    with torch.no_grad():
        logits = model(exp.sequences, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    return torch.log_softmax(logits.float()[:, :-1] / TEMP, -1).gather(-1, exp.sequences[:, 1:, None])[..., 0]


def test_actor_methods_against_hf(tmp_path):
    tmp = str(tmp_path)
    model = tiny_dir(os.path.join(tmp, "hf"))
    res = run_multiprocess(_worker, world_size=2, args=(tmp,), timeout=180)
    r = res[0]
    # forward: old log-probs equal HF's (times action_mask), per experience
    for exp, lp in zip(experiences(), r["lp"]):
        am = exp.attention_mask
        with torch.no_grad():
            logits = model(exp.sequences, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
        ref = torch.log_softmax(logits.float()[:, :-1] / TEMP, -1).gather(-1, exp.sequences[:, 1:, None])[..., 0]
        torch.testing.assert_close(lp, ref * exp.action_mask, rtol=1e-5, atol=2e-6)
    for lp, ref_lp in zip(r["lp"], r["ref_lp"]):       # the frozen reference actor: same numbers
        assert torch.equal(lp, ref_lp)
    # fit: one optimiser step (batch_size 6 = all rows, 3 micro-batches) equals the reference
    loss, sd = _reference(model)
    assert r["status"]["div/loss"] == pytest.approx(loss, rel=1e-5)
    assert res[1]["status"]["div/loss"] == pytest.approx(loss, rel=1e-5)
    assert r["status"]["policy_loss"] == r["status"]["div/loss"] and "actor_grad_norm" in r["status"]
    for k, v in r["after"].items():
        torch.testing.assert_close(v, sd[k], rtol=1e-4, atol=1e-6, msg=k)
    # checkpoint: client state and weights come back
    assert r["states"] == {"global_step": 1, "total_consumed_prompts": 6}
    for k, v in r["after"].items():
        assert torch.equal(r["resumed"][k], v), k
    # save_model: a Hugging Face checkpoint transformers can load, with the trained weights
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "hf_out"))
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, r["after"][k], rtol=0, atol=0, msg=k)
    # offload frees optimiser state and gradients, keeps the parameters; reload is bit-exact
    assert r["offloaded_bytes"] > 0 and r["grad_storage_while_offloaded"] == 0
    assert r["param_storage_while_offloaded"] > 0 and r["lp_offloaded_equal"]
    assert r["lp_reloaded_equal"]


def test_hook_and_contract_helpers():
    args = make_args("/tmp")
    assert uses_megatron(args)
    assert not uses_megatron(NS(div=NS(actor_backend="deepspeed")))
    assert actor_class_for(NS(div=NS(actor_backend="deepspeed"))) is None
    assert reference_class_for(NS()) is None
    m = resolve_method(args)
    assert m.name == "dph_js" and m.anchor_weight == 0.5
    # anchor rows without stored base log-probs are refused with a clear error
    exp = experiences()[0]
    rows = rows_from_experience(exp, m)
    assert [bool(r["is_anchor"]) for r in rows] == [False, True, False]
    assert "anchor_ref_log_probs" in rows[1] and "ref_log_probs" in rows[0]
    assert [bool(r["correct"]) for r in rows] == [True, False, True]       # reward >= 1
    exp.base_action_log_probs = None
    with pytest.raises(ValueError, match="base_action_log_probs"):
        rows_from_experience(exp, m)


def test_actor_class_for_sets_openrlhf_layout():
    pytest.importorskip("ray")
    args = make_args("/tmp")
    args.megatron.tp, args.megatron.pp = 4, 2
    cls = actor_class_for(args)
    assert args.ds.tensor_parallel_size == 8          # OpenRLHF's duplicate_actors = tp * pp
    assert hasattr(cls, "remote") and hasattr(cls, "options")


# ---------------------------------------------------------------------------- OpenRLHF's real order
def _replay_worker(rank, world, tmp):
    """The policy group's calls in OpenRLHF 0.11.2's order under the configs' colocation flags
    (--train.colocate_all --ds.enable_sleep --vllm.enable_sleep), two PPO steps. File:line refer
    to site-packages/openrlhf/trainer/."""
    from openrlhf_div.engines.megatron.actor import MegatronPolicyActor

    args = make_args(tmp)
    args.train.colocate_all, args.ds.enable_sleep = True, True
    args.vllm.enable_sleep, args.vllm.enable_prefix_caching = True, False
    args.ckpt.path = os.path.join(tmp, "replay_ckpt")
    out = {"lp": [], "sent": [], "status": [], "offloaded": {}}
    a = MegatronPolicyActor(world, rank, "127.0.0.1", None)
    # ray/ppo_actor.py:581-582: init offloads under ds.enable_sleep (before vLLM first wakes up)
    a.init_model_from_pretrained(NS(args=args), os.path.join(tmp, "hf"), max_steps=5)
    out["offloaded"]["init"] = a.engine.offloaded
    grad_buf = a.engine.model.buffers[0].grad_data
    out["grad_bytes_at_init"] = grad_buf.untyped_storage().nbytes()
    # vLLM stands in as a recorder of what the weight sync hands over (the IPC path: every rank
    # contributes each full tensor); the real engine is the end-to-end test's
    sent = {}
    a.vllm_engines = ["recorder"]
    a._send_weight = lambda name, t, last: sent.__setitem__(name, t.detach().clone())
    exps = experiences()
    for step in range(2):
        # ppo_utils/experience_maker.py:102: old log-probs through execute_batch("forward"), offloaded
        out["lp"].append(a.execute_batch("forward", dict(sequences=[e.sequences for e in exps],
                                                         attention_mask=[e.attention_mask for e in exps],
                                                         action_mask=[e.action_mask for e in exps]), 0, 2))
        a.execute_batch("append", dict(experience=exps), 0, 2)          # ppo_trainer.py:234
        a.reload_states()                                               # ppo_trainer.py:276
        out["status"].append(a.fit(kl_ctl=0.0))                         # ppo_trainer.py:277-278
        a.offload_states()                                              # ppo_trainer.py:279
        out["offloaded"][f"after_fit{step}"] = a.engine.offloaded
        out["grad_bytes_offloaded"] = grad_buf.untyped_storage().nbytes()
        a.broadcast_to_vllm()          # ppo_trainer.py:316 (after vLLM wake_up(tags=["weights"]), :314)
        out["sent"].append(dict(sent))
        sent.clear()
        if step == 0:                  # ppo_trainer.py:384-402 save_logs_and_checkpoints, still offloaded
            a.save_checkpoint("global_step1", client_states={"global_step": 1})
            out["offloaded"]["after_save"] = a.engine.offloaded
    out["lp"].append(a.forward(exps[0].sequences, exps[0].action_mask, exps[0].attention_mask))
    return out


def test_openrlhf_call_order_with_sleep(tmp_path):
    """init (offloads) -> forward -> append -> reload/fit/offload -> broadcast -> save -> next
    forward, twice, at TP=2: log-probs and exported weights equal the unsharded HF model's after
    the same AdamW steps (Adam state survives offload/reload: step 2 matches)."""
    tmp = str(tmp_path)
    model = tiny_dir(os.path.join(tmp, "hf"))
    res = run_multiprocess(_replay_worker, world_size=2, args=(tmp,), timeout=240)
    exps = experiences()
    steps = [{k: v.clone() for k, v in model.state_dict().items()}]
    steps += _reference(model, steps=2)[1]
    for r in res:
        assert all(r["offloaded"].values()), r["offloaded"]
        assert r["grad_bytes_at_init"] == 0 and r["grad_bytes_offloaded"] == 0
        for step in range(2):
            model.load_state_dict(steps[step])
            for exp, lp in zip(exps, r["lp"][step]):       # old log-probs before step `step + 1`
                torch.testing.assert_close(lp, hf_log_probs(model, exp) * exp.action_mask, rtol=1e-4, atol=2e-5)
            sent = r["sent"][step]                          # weights handed to vLLM after it
            assert sorted(sent) == sorted(steps[step + 1])
            for k, v in sent.items():
                torch.testing.assert_close(v, steps[step + 1][k], rtol=1e-4, atol=1e-5, msg=k)
        model.load_state_dict(steps[2])
        torch.testing.assert_close(r["lp"][2], hf_log_probs(model, exps[0]) * exps[0].action_mask,
                                   rtol=1e-4, atol=2e-5)
        assert r["status"][1]["actor_grad_norm"] > 0


# ---------------------------------------------------------------------------- pre-sampling
def _pef_rows():
    g = torch.Generator().manual_seed(11)
    rows = []
    for i, (P, R) in enumerate(((4, 5), (6, 3), (3, 7))):
        rows.append({"id": f"q{i}", "prompt": f"p{i}", "label": "x", "response": "r",
                     "prompt_ids": torch.randint(1, V, (P,), generator=g).tolist(),
                     "response_ids": torch.randint(1, V, (R,), generator=g).tolist()})
    return rows


def _presample_worker(rank, world, tmp):
    """D_pef base log-probs from the Megatron reference (the pre-sampling stage's batching and
    storing), then the stored rows as training anchors: the policy's step-0 forward on them."""
    from openrlhf_div.engines.megatron.actor import MegatronPolicyActor, MegatronReferenceActor
    from openrlhf_div.engines.openrlhf.anchors import anchor_experience
    from openrlhf_div.engines.anchor_data import AnchorRecord
    from openrlhf_div.engines.openrlhf.presample import base_log_prob_batches, store_base_log_probs

    args = make_args(tmp)
    ref = MegatronReferenceActor(world, rank, "127.0.0.1", None)
    ref.init_model_from_pretrained(NS(args=args), os.path.join(tmp, "hf"))
    pef = _pef_rows()
    batches = base_log_prob_batches(pef, pad_id=0, micro=2)
    store_base_log_probs(batches, [ref.forward(seq, am, attn) for _, seq, attn, am in batches])
    policy = MegatronPolicyActor(world, rank, "127.0.0.1", None)
    policy.init_model_from_pretrained(NS(args=args), os.path.join(tmp, "hf"), max_steps=5)
    exp = anchor_experience([AnchorRecord.from_json(r) for r in pef], pad_token_id=0)
    lp = policy.forward(exp.sequences, exp.action_mask, exp.attention_mask)
    return {"pef": pef, "stored": exp.base_action_log_probs, "policy": lp, "mask": exp.action_mask}


def test_presample_base_log_probs_from_megatron_reference(tmp_path):
    """The Megatron configs' pre-sampling: stored D_pef log-probs (Megatron reference, TP=2) equal
    the policy's log-probs at step 0 on the same tokens, and HF's."""
    tmp = str(tmp_path)
    model = tiny_dir(os.path.join(tmp, "hf"))
    res = run_multiprocess(_presample_worker, world_size=2, args=(tmp,), timeout=120)
    for r in res:
        assert all(len(row["ref_log_probs"]) == len(row["response_ids"]) for row in r["pef"])
        torch.testing.assert_close(r["policy"] * r["mask"], r["stored"], rtol=1e-5, atol=1e-6)
        assert (r["stored"] != 0).sum() == sum(len(row["response_ids"]) for row in r["pef"])
    for row in res[0]["pef"]:
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float()[0, :-1] / TEMP, -1)
        want = logp.gather(-1, ids[0, 1:, None])[:, 0][len(row["prompt_ids"]) - 1:]
        torch.testing.assert_close(torch.tensor(row["ref_log_probs"]), want, rtol=1e-5, atol=2e-6)


def test_presample_uses_the_megatron_reference_for_megatron_configs():
    pytest.importorskip("ray")
    from openrlhf_div.compat import install_flash_attn_standin, install_vllm_stub

    install_flash_attn_standin()
    install_vllm_stub()        # OpenRLHF's Ray package imports vllm (none on CPU unless installed)
    from openrlhf_div.engines.openrlhf.presample import reference_actor_class

    args = make_args("/tmp")
    args.megatron.tp = 4
    cls = reference_actor_class(args)
    assert cls.__ray_actor_class__.__name__ == "MegatronReferenceActor"
    assert args.ds.tensor_parallel_size == 4        # the group de-duplicates TP replicas
    args.div.actor_backend = "deepspeed"
    assert reference_actor_class(args).__ray_actor_class__.__name__ != "MegatronReferenceActor"
