"""Over-long prompts the DPH-RL authors' way (issue 43 item 8): ``div.drop_long_prompts: true``
drops prompts over ``data.max_len - rollout.max_new_tokens`` from the training, evaluation and
pre-sampling data (the fork's ``filter_overlong_prompts=True``), counted in the log and in the
run folder's ``run_info.json``; authors'-mode configs set it."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from openrlhf_div.engines.prompt_budget import PromptBudgetError, check_prompt_budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNT = lambda s: len(s.split())  # noqa: E731  (one token a word)
PROMPTS = ["a b c", "a " * 7, "a b", "a " * 9]  # 3, 7, 2, 9 tokens


def test_drop_keeps_the_prompts_within_budget_and_says_how_many(capsys):
    out = check_prompt_budget(PROMPTS, COUNT, max_len=10, max_new_tokens=4, drop=True)  # budget 6
    assert out["keep"] == [0, 2] and out["over"] == 2 and out["prompts"] == 4
    assert "dropped 2 of 4 prompts longer than the prompt budget of 6 tokens" in capsys.readouterr().out
    with pytest.raises(PromptBudgetError, match="both true: choose one"):
        check_prompt_budget(PROMPTS, COUNT, max_len=10, max_new_tokens=4, drop=True, truncate=True)
    with pytest.raises(PromptBudgetError, match="would leave none: raise data.max_len to at least 13"):
        check_prompt_budget(PROMPTS[1::2], COUNT, max_len=10, max_new_tokens=4, drop=True)
    # the default still stops, and now names the authors' way too
    with pytest.raises(PromptBudgetError, match="div.drop_long_prompts: true to drop them"):
        check_prompt_budget(PROMPTS, COUNT, max_len=10, max_new_tokens=4)


class _Dataset:
    def __init__(self, prompts):
        self.prompts = list(prompts)
        self.labels = [f"l{i}" for i in range(len(prompts))]
        self.images = [None] * len(prompts)
        self.datasources = ["default"] * len(prompts)

    def __len__(self):
        return len(self.prompts)

    def collate_fn(self, rows):  # pragma: no cover - never called here
        return rows


class _Strategy:
    def __init__(self):
        self.calls = []

    def setup_dataloader(self, dataset, batch_size, pin_memory, shuffle, collate_fn, num_workers=0):
        self.calls.append((len(dataset), batch_size, shuffle, num_workers))
        return SimpleNamespace(dataset=dataset, shuffle=shuffle)


def _args(run_dir, drop):
    return SimpleNamespace(
        div=SimpleNamespace(drop_long_prompts=drop, truncate_prompts=False),
        data=SimpleNamespace(max_len=10, dataloader_num_workers=0),
        rollout=SimpleNamespace(max_new_tokens=4, n_samples_per_prompt=4),
        train=SimpleNamespace(batch_size=8, num_episodes=1, max_epochs=1),
        ckpt=SimpleNamespace(output_dir=os.path.join(run_dir, "model")))


def _trainer(train, evals):
    tok = lambda text=None, add_special_tokens=False: {"input_ids": text.split()}  # noqa: E731
    return SimpleNamespace(tokenizer=tok, strategy=_Strategy(), max_steps=len(train) * 4 // 8,
                           prompts_dataloader=SimpleNamespace(dataset=_Dataset(train)),
                           eval_dataloader=SimpleNamespace(dataset=_Dataset(evals)))


def test_the_ray_trainer_drops_rebuilds_and_records(tmp_path, capsys):
    """The controller's check: the long prompts leave the training and evaluation sets (with their
    labels), the loaders and the step count are rebuilt as OpenRLHF's prepare_datasets builds them,
    and run_info.json gets the counts."""
    pytest.importorskip("openrlhf")
    from openrlhf_div.engines.openrlhf.trainer import _check_prompts

    (tmp_path / "run_info.json").write_text(json.dumps({"engine": "openrlhf"}))
    train = PROMPTS * 4                      # 16 prompts, 8 over budget
    t = _trainer(train, PROMPTS)
    _check_prompts(t, _args(str(tmp_path), drop=True))
    ds = t.prompts_dataloader.dataset
    assert ds.prompts == [p for p in train if COUNT(p) <= 6] and len(ds.labels) == len(ds.images) == 8
    assert ds.labels == [f"l{i}" for i, p in enumerate(train) if COUNT(p) <= 6]
    assert t.prompts_dataloader.shuffle is True and t.eval_dataloader.shuffle is False
    assert t.eval_dataloader.dataset.prompts == ["a b c", "a b"]
    assert t.max_steps == 8 * 4 // 8          # was 16 * 4 // 8
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["dropped_long_prompts"] == {"data.prompt_dataset": {"dropped": 8, "of": 16, "budget": 6},
                                            "eval.dataset": {"dropped": 2, "of": 4, "budget": 6}}
    out = capsys.readouterr().out
    assert "data.prompt_dataset: dropped 8 of 16" in out and "eval.dataset: dropped 2 of 4" in out


def test_without_drop_the_ray_trainer_still_stops(tmp_path):
    pytest.importorskip("openrlhf")
    from openrlhf_div.engines.openrlhf.trainer import _check_prompts

    t = _trainer(PROMPTS, ["a"])
    with pytest.raises(PromptBudgetError, match="2 of 4 prompts"):
        _check_prompts(t, _args(str(tmp_path), drop=False))
    assert t.strategy.calls == []


def test_authors_mode_configs_drop_and_the_driver_reads_it():
    """The authors'-mode configs (Llama-SQL family, OmniSQL Megatron *_authors) set it, and the
    driver's parser turns it into div.drop_long_prompts = True."""
    import argparse

    from openrlhf_div.config import load_experiment
    from openrlhf_div.engines.flags import add_div_arguments
    from openrlhf_div.engines.openrlhf.launch import config_argv

    parser = argparse.ArgumentParser()
    add_div_arguments(parser)
    assert vars(parser.parse_args(["--div.drop_long_prompts", "true"]))["div.drop_long_prompts"] is True
    assert vars(parser.parse_args([]))["div.drop_long_prompts"] is False
    for name in ("configs/openrlhf/llama8b_bird_dph_js.yaml", "configs/openrlhf/llama8b_bird_grpo.yaml",
                 "configs/megatron/omnisql32b_bird_dph_js_megatron_tp8_authors.yaml",
                 "configs/megatron/omnisql32b_bird_dph_f_megatron_2node_authors.yaml"):
        cfg = load_experiment(os.path.join(ROOT, name))
        assert cfg["div"]["drop_long_prompts"] is True, name
        argv = config_argv(cfg)  # what the driver is handed
        assert argv[argv.index("--div.drop_long_prompts") + 1] == "true", name
    for name in ("configs/openrlhf/omnisql32b_bird_dph_js.yaml", "configs/megatron/omnisql32b_bird_dph_js_megatron_tp8.yaml"):
        assert not load_experiment(os.path.join(ROOT, name)).get("div", {}).get("drop_long_prompts"), name
