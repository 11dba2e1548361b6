"""Issue 35 beyond the replay (tests/test_authors_replay.py): what `authors_world_size` implies
per optimiser step (the numbers `openrlhf-div methods NAME --config` prints), the configs'
authors' optimizer / schedule / greedy validation / layout, no silent prompt truncation, and the
final evaluation's greedy column. Cost: about 10 s (two launcher dry runs)."""
from __future__ import annotations

import pytest

from openrlhf_div.algorithms import get_method
from openrlhf_div.algorithms.authors import layout_report, plan_micro_batches
from openrlhf_div.engines.layout import EngineLayout


def _authors(world, **kw):
    """dph_js as the authors run it, and the micro-batch layout (``layout:``) at their GPU count."""
    return (get_method("dph_js", anchor_eta=0.01, anchor_weighting="microbatch_share",
                       aggregation="micro-batch-token-mean", **kw),
            EngineLayout(step_layout="authors", authors_world_size=world, mixed_micro_batches="first_row"))


def _per_step(world, budget=None, tokens=3000):
    steps = plan_micro_batches([False] * 2048 + [True] * 256, [tokens] * 2304, mini_batch_rows=1024 // world,
                               micro_batch_seqs=2, micro_batch_tokens=budget, step_layout="authors",
                               authors_world_size=world, mixed_micro_batches="first_row")
    return [(round(sum(m.coef for m in s if not m.anchor), 6), round(sum(m.coef for m in s if m.anchor), 6),
             sum(len(m.ppo_anchors) for m in s)) for s in steps]


def test_the_authors_steps_at_their_gpu_count():
    """2048 rollouts + 256 anchors, 1024 rows per step (scripts/llama/*.sh): one GPU gives two
    rollout steps and a quarter-size anchor step; 8 and 32 GPUs spread the anchors over all
    three steps (eta x 0.094 / 0.125 / 0.031) and the third step carries 0.219 of a step of
    rollouts; every layout keeps eta x 1/8 and two steps of rollouts in total."""
    assert _per_step(1) == [(1.0, 0.0, 0), (1.0, 0.0, 0), (0.0, 0.25, 0)]
    for w in (8, 32):
        assert _per_step(w) == [(0.90625, 0.09375, 0), (0.875, 0.125, 0), (0.21875, 0.03125, 0)]
    for w in (1, 2, 4, 8, 16, 32):
        per = _per_step(w)
        assert sum(r for r, _, _ in per) == pytest.approx(2.0) and sum(a for _, a, _ in per) == pytest.approx(0.25)
    # token budgets: at 8 GPUs the last rank's first mini-batch (32 rollouts + 96 anchors) is one
    # mixed partition per micro-batch, routed by its first row -> 96 anchors at the PPO loss
    assert [r for _, _, r in _per_step(8, budget=32384)] == [96, 0, 0]
    assert [r for _, _, r in _per_step(32, budget=32384)] == [0, 0, 0]


def test_layout_report_lines():
    method, layout = _authors(32)
    lines = layout_report(method, 2048, 256, 1024, layout=layout.to_dict())
    assert "GPU count 32" in lines[0] and len(lines) == 4
    assert "eta x 0.094 = 0.00094" in lines[1] and "eta x 0.031 = 0.00031" in lines[3]
    assert "0.219 of a step" in lines[3]


def test_layout_refuses_what_the_authors_cannot_split():
    with pytest.raises(ValueError, match="equal chunks"):
        plan_micro_batches([False] * 30 + [True] * 3, [5] * 33, mini_batch_rows=4, authors_world_size=2,
                           step_layout="authors", mixed_micro_batches="first_row")
    with pytest.raises(ValueError, match="needs authors_world_size"):
        plan_micro_batches([False] * 4, mini_batch_rows=2, step_layout="authors", mixed_micro_batches="first_row")
    with pytest.raises(ValueError, match="step_layout: authors"):
        EngineLayout(step_layout="spread", authors_world_size=8)
    with pytest.raises(ValueError, match="set layout.authors_world_size too"):
        EngineLayout(step_layout="authors", mixed_micro_batches="first_row")
    with pytest.raises(ValueError, match="unknown layout.mixed_micro_batches"):
        EngineLayout(step_layout="authors", authors_world_size=8, mixed_micro_batches="last_row")
    # micro-batch layout, not method hyperparameters: a method given them names the layout: key
    for key, value in (("authors_world_size", 8), ("mixed_micro_batches", "first_row")):
        with pytest.raises(ValueError, match=f"micro-batch layout.*layout.{key}"):
            get_method("dph_f", **{key: value})


def test_methods_cli_prints_the_authors_world_size_and_anchor_weights(capsys):
    from openrlhf_div.cli.main import main

    assert main(["methods", "dph_js", "--config", "configs/openrlhf/llama8b_bird_dph_js.yaml"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch layout (layout:):" in out and "authors_world_size=32" in out and "GPU count 32" in out
    assert "mixed_micro_batches=first_row" in out
    assert "step 1: rollout (PPO) micro-batches 0.906 of a step, anchor weight eta x 0.094 = 0.00094" in out
    assert "step 3: rollout (PPO) micro-batches 0.219 of a step, anchor weight eta x 0.031 = 0.00031" in out


def test_authors_configs_set_the_forks_optimizer_and_validation_and_spec_configs_keep_ours():
    from openrlhf_div.engines.openrlhf import launch

    auth = launch.plan(["--config", "configs/openrlhf/llama8b_bird_dph_f.yaml", "--dry-run"]).args
    assert tuple(auth.actor.adam.betas) == (0.9, 0.999) and auth.actor.adam.weight_decay == 0.01
    assert auth.actor.lr_scheduler == "constant_with_warmup" and auth.eval.temperature == 0.0
    assert auth.eval.n_samples_per_prompt == 1 and auth.eval.steps == 40
    spec = launch.plan(["--config", "configs/openrlhf/llama8b_bird_dph_js_spec.yaml", "--dry-run"])
    assert tuple(spec.args.actor.adam.betas) == (0.9, 0.95) and spec.args.actor.adam.weight_decay == 0.0
    assert "authors_world_size" not in spec.method.hparams  # micro-batch layout, not the method's
    assert EngineLayout.from_args(spec.args).authors_world_size is None
    assert EngineLayout.from_args(auth).authors_world_size == 32


def test_megatron_configs_agree_with_the_deepspeed_ones():
    """dph_f in authors' mode: micro-batches of 2 rows as forward_kl.sh on both engines; the
    OmniSQL DPH rows get one anchor weighting (eta x 256/2048) on DeepSpeed and Megatron."""
    from openrlhf_div.config import load_experiment

    for path in ("configs/megatron/omnisql32b_bird_dph_f_megatron_tp8_authors.yaml",
                 "configs/megatron/omnisql32b_bird_dph_f_megatron_2node_authors.yaml",
                 "configs/openrlhf/llama8b_bird_dph_f.yaml"):
        exp = load_experiment(path)
        assert exp["layout"]["micro_batch_tokens"] is None and exp["method"]["micro_batch_seqs"] == 2, path
    weighting = {load_experiment(p)["method"].get("anchor_weighting") for p in (
        "configs/openrlhf/omnisql32b_bird_dph_f.yaml", "configs/megatron/omnisql32b_bird_dph_f_megatron_tp8.yaml",
        "configs/megatron/omnisql32b_bird_dph_f_megatron_2node.yaml",
        "configs/megatron/omnisql32b_bird_dph_f_megatron_tp8_authors.yaml")}
    assert weighting == {"microbatch_share"}


def test_prompts_over_the_budget_stop_the_run_with_their_count():
    from openrlhf_div.engines.prompt_budget import PromptBudgetError, check_prompt_budget

    count = lambda s: len(s.split())  # noqa: E731
    prompts = ["a b c", "a " * 7, "a " * 9]
    with pytest.raises(PromptBudgetError, match=r"2 of 3 prompts are longer than the prompt budget of 6 tokens"):
        check_prompt_budget(prompts, count, max_len=10, max_new_tokens=4)
    with pytest.raises(PromptBudgetError, match="at least 13"):
        check_prompt_budget(prompts, count, max_len=10, max_new_tokens=4)
    assert check_prompt_budget(prompts, count, max_len=10, max_new_tokens=4, truncate=True)["over"] == 2
    assert check_prompt_budget(prompts, count, max_len=13, max_new_tokens=4)["over"] == 0


def test_final_evaluation_report_has_a_greedy_column():
    from openrlhf_div.engines.openrlhf.evaluate import defaults_from_config
    from openrlhf_div.eval.report import _columns, _table, build_metrics

    assert defaults_from_config("configs/openrlhf/llama8b_bird_dph_f.yaml")["greedy"] is True
    assert "greedy" not in defaults_from_config("configs/openrlhf/omnisql32b_bird_dph_f.yaml")
    base = {"pass@1": 0.5, "pass@8": 0.8, "pass@16": 0.9, "greedy": 0.55}
    m = build_metrics("sql", base, {"dph_f": {0: {**base, "greedy": 0.625}}})
    cols = _columns(m, None)
    assert ("greedy", "greedy") in cols
    assert "| dph_f | 0.500 | 0.800 | 0.900 | 0.625 |" in _table([("dph_f", m["methods"]["dph_f"])], cols)
    nog = build_metrics("sql", {k: v for k, v in base.items() if k != "greedy"},
                        {"m": {0: {k: v for k, v in base.items() if k != "greedy"}}})
    assert ("greedy", "greedy") not in _columns(nog, None)


def _gather_worker(rank, world):
    import torch

    from openrlhf_div.algorithms.authors import share_micro_batches
    from openrlhf_div.engines.contract import gather_step_rows

    g = torch.Generator().manual_seed(rank)
    mine = [{"id": torch.tensor(rank * 100 + i), "is_anchor": torch.tensor(i >= 12),
             "tokens": torch.randint(4, 30, (1,), generator=g)} for i in range(16)]
    rows, dp, me = gather_step_rows(mine)
    flags = [bool(r["is_anchor"]) for r in rows]
    tokens = [int(r["tokens"]) for r in rows]
    steps = plan_micro_batches(flags, tokens, mini_batch_rows=4, micro_batch_tokens=40, authors_world_size=4,
                               step_layout="authors", mixed_micro_batches="first_row")
    share = [[None if mb is None else ([int(rows[i]["id"]) for i in mb.rows], mb.coef)
              for mb in share_micro_batches(st, dp, me)] for st in steps]
    whole = [[([int(rows[i]["id"]) for i in mb.rows], mb.coef) for mb in st] for st in steps]
    return {"ids": [int(r["id"]) for r in rows], "dp": dp, "rank": me, "share": share, "whole": whole}


@pytest.mark.slow  # two spawned gloo processes: ~35 s on the shared 2-core machine (their imports)
def test_engine_ranks_gather_the_step_and_share_it():
    """Two gloo ranks (our data parallelism) each hold their own rows; `authors_world_size` plans
    the whole step on both (the same rows in rank order) and each runs its share of every step's
    micro-batches at twice the coefficient (the engines average the two ranks' gradients)."""
    from openrlhf_div.compat.mcore_cpu import run_multiprocess

    res = run_multiprocess(_gather_worker, world_size=2, timeout=120)
    want = [r * 100 + i for r in range(2) for i in range(16)]
    assert res[0]["ids"] == want and res[1]["ids"] == want and (res[0]["dp"], res[1]["rank"]) == (2, 1)
    assert res[0]["whole"] == res[1]["whole"]
    for s, step in enumerate(res[0]["whole"]):
        shares = [mb for r in (0, 1) for mb in res[r]["share"][s] if mb is not None]
        assert len(res[0]["share"][s]) == len(res[1]["share"][s])  # the same number of backward calls
        assert sorted((rows, 2 * c) for rows, c in step) == sorted((rows, c) for rows, c in shares)
