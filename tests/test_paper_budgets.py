"""The paper configs' prompt / response budgets are the authors' (issue 35 item 4).

One row per paper experiment family: the prompt and response budgets its authors ran, their GPU
count and the source of each figure (a script line or a paper section). The checks:

* every paper config under configs/openrlhf and configs/megatron (all but the tiny CPU ones) is
  covered by exactly one row;
* through the launcher's own parser (``launch.plan(... --dry-run)``, the path a run takes),
  ``data.max_len - rollout.max_new_tokens`` (OpenRLHF's prompt budget, engines/prompt_budget.py)
  and ``rollout.max_new_tokens`` equal the row's, and ``data.max_len`` fits the model's context;
* the planners accept each config at the authors' GPU count: the engines' micro-batch planner
  (``authors.plan_micro_batches`` through ``layout_report``) lays one rollout step out at
  ``layout.authors_world_size`` with every row at ``data.max_len`` tokens (a token budget must hold
  the longest row, as verl asserts), and the Megatron memory planner (``plan-memory``) fits each
  Megatron config on 80 GB GPUs at the authors' GPU count and at its own.

The DeepSpeed (OpenRLHF) actor's memory is not modelled by any planner here (docs/configs.md,
"Prompt and response budgets"): for those configs only the token arithmetic is checked.
"""
from __future__ import annotations

import fnmatch
import glob
import os

import pytest

from openrlhf_div.algorithms.authors import MICRO_BATCH_TOKEN_MEAN, layout_report
from openrlhf_div.engines.anchor_data import anchor_count
from openrlhf_div.engines.flags import div_namespace
from openrlhf_div.engines.layout import EngineLayout
from openrlhf_div.engines.megatron import memory_plan as MM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DPH = "seamoke/DPH-RL@139a9b2"
SQL_PROMPT = (f"{DPH} scripts/llama/js_kl.sh:211 data.max_prompt_length=16000 (every scripts/llama/*.sh; "
              ":213 filter_overlong_prompts=True drops longer prompts)")
SQL_RESPONSE = "DPH-RL paper App. D.3 Table 6 Max Response Length 4096; scripts/llama/js_kl.sh:166 maxlen=4096 -> :212"
DPH_GPUS = "DPH-RL paper App. D.3: 32 A800-80G"

# (configs under configs/, prompt tokens, response tokens, authors' GPU count, model context, source)
# model context: max_position_embeddings of the model's config.json
AUTHORS_BUDGETS = [
    ("openrlhf/llama8b_bird_*.yaml", 16000, 4096, 32, 131072,
     f"{SQL_PROMPT}; {SQL_RESPONSE} (Llama-SQL); {DPH_GPUS}"),
    ("openrlhf/omnisql32b_bird_*.yaml", 16000, 4096, 32, 32768,
     f"no OmniSQL script is published: the fork's SQL scripts' prompt length, {SQL_PROMPT}; Table 6 Max Response "
     f"Length 4096 (OmniSQL-32B-SQL); {DPH_GPUS}"),
    ("megatron/omnisql32b_bird_*.yaml", 16000, 4096, 32, 32768,
     f"as configs/openrlhf/omnisql32b_bird_*: {SQL_PROMPT}; Table 6 (OmniSQL-32B-SQL) 4096; {DPH_GPUS}"),
    ("openrlhf/qwen25math7b_dapo17k_*.yaml", 1024, 2048, 32, 4096,
     f"Table 6 Max Response Length 2048 (Qwen2.5-Math); no math script is published: the prompt length of the "
     f"Hydra config every DPH-RL script loads, {DPH} examples/sglang_multiturn/config/sql_single_grpo.yaml:10 "
     f"max_prompt_length: 1024; {DPH_GPUS}"),
    ("openrlhf/qwen25math7b_ds_grpo.yaml", 1024, 2048, 4, 4096,
     "Differential Smoothing paper App. C.3, Qwen2.5-Math-7B table: max prompt length 1024, max response length "
     "2048, 4 x A100"),
    ("openrlhf/qwen25math15b_ds_grpo.yaml", 1024, 2048, 4, 4096,
     "Differential Smoothing paper App. C.3, Qwen2.5-Math-1.5B table: max prompt length 1024, max response length "
     "2048, 4 GPUs"),
    ("openrlhf/qwen25_7b_dapomath_lad_js.yaml", 2048, 8192, 2, 131072,
     "LAD paper App. C.2: max length 8192, 2 H200, 'following the experimental protocol of entropy-mechanism': "
     "PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/7b_kl_cov.sh:20-21 max_prompt_length=$((1024 * 2)), "
     "max_response_length=$((1024 * 8))"),
]

GPU_GIB = 79.0  # usable memory of an 80 GB GPU (A800-80G / H100), as tests/test_megatron_configs.py


def paper_configs():
    out = []
    for sub in ("openrlhf", "megatron"):
        for p in sorted(glob.glob(os.path.join(ROOT, "configs", sub, "[!_]*.yaml"))):
            if not os.path.basename(p).startswith(("tiny_cpu", "smollm2_")):  # not paper experiments
                out.append(os.path.relpath(p, os.path.join(ROOT, "configs")))
    return out


def rows_of(rel: str, table=AUTHORS_BUDGETS):
    return [row for row in table if fnmatch.fnmatch(rel, row[0])]


def configs_of(row):
    return [rel for rel in paper_configs() if fnmatch.fnmatch(rel, row[0])]


_PLANS = {}


def plan_of(rel: str):
    """The run's arguments as the launcher resolves them (``openrlhf-div run ... --dry-run``)."""
    if rel not in _PLANS:
        from openrlhf_div.engines.openrlhf import launch

        _PLANS[rel] = launch.plan(["--config", os.path.join(ROOT, "configs", rel), "--dry-run"])
    return _PLANS[rel]


def budget_errors(rel: str, row) -> list:
    """Where ``rel``'s resolved budgets differ from the row's (empty: equal)."""
    _, prompt, response, _, context, source = row
    a = plan_of(rel).args
    max_len, new = int(a.data.max_len), a.rollout.max_new_tokens
    errs = []
    if new is None or int(new) != response:
        errs.append(f"{rel}: rollout.max_new_tokens {new}, the authors' response budget is {response} ({source})")
    elif max_len - int(new) != prompt:
        errs.append(f"{rel}: prompt budget data.max_len {max_len} - rollout.max_new_tokens {new} = "
                    f"{max_len - int(new)}, the authors' is {prompt}: data.max_len {prompt + response} ({source})")
    if max_len > context:
        errs.append(f"{rel}: data.max_len {max_len} exceeds the model's context {context}")
    return errs


# ------------------------------------------------------------------ the tests
def test_every_paper_config_has_exactly_one_row():
    configs = paper_configs()
    assert len(configs) >= 30, configs
    bad = {rel: [r[0] for r in rows_of(rel)] for rel in configs if len(rows_of(rel)) != 1}
    assert not bad, f"paper configs without exactly one AUTHORS_BUDGETS row: {bad}"
    assert all(configs_of(row) for row in AUTHORS_BUDGETS), "a row matches no config"


@pytest.mark.parametrize("row", AUTHORS_BUDGETS, ids=[r[0] for r in AUTHORS_BUDGETS])
def test_budgets_equal_the_authors(row):
    errs = [e for rel in configs_of(row) for e in budget_errors(rel, row)]
    assert not errs, "\n".join(errs)


def test_a_changed_budget_fails():
    """Mutations: one budget changed in the table (prompt, response), or in a config's resolved
    arguments, is caught by the check the test above runs."""
    row = rows_of("openrlhf/llama8b_bird_dph_js.yaml")[0]
    rel = "openrlhf/llama8b_bird_dph_js.yaml"
    assert budget_errors(rel, row) == []
    assert budget_errors(rel, (row[0], 2048) + row[2:])            # the old 2,048-token prompt budget
    assert budget_errors(rel, row[:2] + (8192,) + row[3:])          # a response budget
    assert budget_errors(rel, row[:4] + (16384,) + row[5:])         # a context the rows do not fit
    a = plan_of(rel).args
    old = a.data.max_len
    try:
        a.data.max_len = 6144                                        # the config's value before this change
        assert any("prompt budget" in e for e in budget_errors(rel, row))
    finally:
        a.data.max_len = old


def _authors_world(rel: str, row) -> int:
    a = plan_of(rel).args
    aws = EngineLayout.from_args(a).authors_world_size
    return int(aws) if aws is not None else row[3]


@pytest.mark.parametrize("rel", [r for r in paper_configs() if len(rows_of(r)) == 1])
def test_micro_batch_planner_accepts_the_config_at_the_authors_gpu_count(rel):
    """Under the authors' aggregation the engines' planner lays one rollout step out at
    ``layout.authors_world_size`` with every row ``data.max_len`` tokens long (the worst case a
    token budget must hold); ``layout.authors_world_size`` is the row's GPU count where set."""
    row = rows_of(rel)[0]
    p = plan_of(rel)
    a, method = p.args, p.method
    layout = EngineLayout.from_args(a)
    if layout.authors_world_size is not None:
        assert layout.authors_world_size == row[3], (rel, layout.authors_world_size, row[5])
    if method.aggregation != MICRO_BATCH_TOKEN_MEAN:
        assert layout.micro_batch_tokens is None or int(layout.micro_batch_tokens) >= int(a.data.max_len)
        return
    online = a.rollout.batch_size * a.rollout.n_samples_per_prompt
    n_anchor = 0
    if method.needs.anchor_batch:
        div = div_namespace(a)
        n_anchor = anchor_count(online, div.anchor_batch_size, div.anchor_ratio)
    lines = layout_report(method, online, n_anchor, a.train.batch_size, row_tokens=int(a.data.max_len),
                          layout=layout.to_dict())
    assert len(lines) >= 2, lines
    if layout.authors_world_size is not None:
        assert f"GPU count {layout.authors_world_size}" in lines[0], lines[0]


def test_a_token_budget_below_the_longest_row_is_refused(tmp_path):
    """Mutation: micro-batches of 16000 tokens cannot hold a 20096-token row (verl asserts
    ppo_max_token_len_per_gpu >= the padded row): the launcher refuses it before any GPU starts,
    and the planner refuses such rows."""
    from openrlhf_div.engines.openrlhf import launch

    base = os.path.join(ROOT, "configs", "openrlhf", "llama8b_bird_dph_js.yaml")
    cfg = tmp_path / "small_budget.yaml"
    cfg.write_text(f"extends: {base}\nlayout:\n  micro_batch_tokens: 16000\n")
    with pytest.raises(ValueError, match="layout.micro_batch_tokens 16000 is smaller than data.max_len 20096"):
        launch.plan(["--config", str(cfg), "--dry-run"])
    p = plan_of("openrlhf/llama8b_bird_dph_js.yaml")
    layout = dict(EngineLayout.from_args(p.args).to_dict(), micro_batch_tokens=16000)
    with pytest.raises(ValueError, match="exceeds micro_batch_tokens=16000"):
        layout_report(p.method, 2048, 256, 1024, row_tokens=20096, layout=layout)


MEGATRON = [r for r in paper_configs() if r.startswith("megatron/")]


@pytest.mark.parametrize("rel", MEGATRON)
def test_megatron_memory_plan_fits_at_the_authors_gpu_count(rel):
    """``openrlhf-div plan-memory --config X --world_size authors``: every phase of a colocated step
    fits an 80 GB GPU with 10 GiB to spare, at the authors' GPU count and on the config's own layout,
    with rows of the authors' ``data.max_len``."""
    cfg = MM.load_config(os.path.join(ROOT, "configs", rel))
    assert int(cfg["openrlhf"]["data.max_len"]) == 16000 + 4096
    for world in (_authors_world(rel, rows_of(rel)[0]), None):
        plan = MM.config_plan(cfg, world)
        assert plan["gpu_peak_gib"] < GPU_GIB - 10, (rel, world, plan)
        assert plan["gpu_fit_gib"] < GPU_GIB - 10, (rel, world, plan)


def test_megatron_memory_plan_mutation():
    """Mutation: the planner is not a constant -- rows of 8x the authors' length at micro-batches of
    2 rows (forward_kl.sh) no longer fit at 32 GPUs, nor the authors' rows with megatron-core's local
    (unfused) attention instead of Transformer Engine's, and a world size the model-parallel size does
    not divide is refused."""
    cfg = MM.load_config(os.path.join(ROOT, "configs", "megatron", "omnisql32b_bird_dph_f_megatron_2node_authors.yaml"))
    at32, own = MM.config_plan(cfg, 32), MM.config_plan(cfg)
    assert at32["gpu_fit_gib"] < GPU_GIB - 10
    # 32 GPUs at TP 8 are 4 data-parallel replicas (2 on the config's two nodes): a smaller optimizer shard
    assert at32["gpu_fit_gib"] == pytest.approx(own["gpu_fit_gib"] - 12 * at32["params_per_gpu_B"] * 1e9 / 4 / (1 << 30))
    assert MM.config_plan(cfg, 32, attention="local")["gpu_fit_gib"] > GPU_GIB - 10   # s^2 score matrices
    cfg["openrlhf"]["data.max_len"] = 8 * 20096
    assert MM.config_plan(cfg, 32)["gpu_fit_gib"] > GPU_GIB - 10
    with pytest.raises(ValueError, match="--world_size 12: not a multiple"):
        MM.config_plan(cfg, 12)


def test_plan_memory_world_size_flag(capsys):
    from openrlhf_div.cli.main import main

    path = os.path.join(ROOT, "configs", "megatron", "omnisql32b_bird_dph_js_megatron_tp8_authors.yaml")
    assert main(["plan-memory", "--config", path, "--world_size", "authors"]) == 0
    out = capsys.readouterr().out
    assert "plan at 32 GPUs" in out and "prompt 16000 + response 4096" in out, out
    assert "micro-batches of 32384 tokens (holds the longest row)" in out, out
