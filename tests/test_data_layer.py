"""The one data layer of train / presample / eval, real-tokenizer handling and the guards
against silent non-learning (issue 16 findings 1-4, issue 14 items 1 and 7's loader parts).
Each test reproduces a reported failure of the old code."""
import json
import logging

import pytest
import torch

from openrlhf_div.engines.local.config import ConfigError, load_config
from openrlhf_div.engines.local.data import render_prompt
from openrlhf_div.engines.local.generation import encode_prompts, generate
from openrlhf_div.engines.local.presample import presample
from openrlhf_div.engines.local.tiny import build_tiny_model
from openrlhf_div.engines.local.tokens import encode_text, stop_token_ids
from openrlhf_div.engines.local.trainer import DegenerateRunError, EmptyAnchorError, Trainer
from openrlhf_div.tasks.datasets import DatasetError, load_examples, render_example

torch.set_num_threads(1)
VOCAB = "abcdef="

GSM8K = [{"question": f"Tom has {a} apples and buys {b}. How many?", "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>"
          f"{a + b}\nSo he has {a + b}.\n#### {a + b:,}"} for a, b in ((17, 25), (3, 4), (600, 900))]
MATH = [{"problem": "What is $1+1$?", "solution": "We add: $1+1=\\boxed{2}$.", "level": "Level 1"},
        {"problem": "Compute $3\\cdot 4$.", "solution": "It is $\\boxed{12}$.", "level": "Level 1"}]


def _ov(train, out, task="toy_copy", extra=()):
    return [f"task={task}", f"output_dir={out}", f"model.tiny_vocab={VOCAB}", f"data.train={train}",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=3", "optim.steps=2",
            "eval.at_start=false", "logging.tensorboard=false", "logging.progress=false", "checkpoint.every=0",
            *extra]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------ formats and layouts
def test_gsm8k_answer_is_parsed_to_its_final_number(tmp_path):
    ex, _ = load_examples(str(_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)), "math")
    assert [e["label"] for e in ex] == ["42", "7", "1500"]  # "1,500" -> "1500"
    assert ex[0]["prompt"].startswith("Tom has 17 apples")


@pytest.mark.parametrize("fmt", ["gsm8k_jsonl", "math_jsonl", "parquet", "save_to_disk", "datasetdict"])
def test_train_reads_every_format_the_eval_loader_reads(fmt, tmp_path):
    import datasets

    extra = []
    if fmt == "gsm8k_jsonl":
        path, labels = _jsonl(tmp_path / "train.jsonl", GSM8K), ["42", "7", "1500"]
    elif fmt == "math_jsonl":
        path, labels = _jsonl(tmp_path / "math.jsonl", MATH), ["2", "12"]
    elif fmt == "parquet":
        path, labels = tmp_path / "train-00000-of-00001.parquet", ["42", "7", "1500"]
        datasets.Dataset.from_list(GSM8K).to_parquet(str(path))
    elif fmt == "save_to_disk":
        path, labels = tmp_path / "gsm8k_disk", ["42", "7", "1500"]
        datasets.Dataset.from_list(GSM8K).save_to_disk(str(path))
    else:
        path, labels = tmp_path / "dd", ["2", "12"]
        datasets.DatasetDict({"train": datasets.Dataset.from_list(MATH),
                              "test": datasets.Dataset.from_list(GSM8K)}).save_to_disk(str(path))
        extra = ["data.split=train"]
    tr = Trainer(load_config(None, _ov(path, tmp_path / "run", task="math", extra=extra)))
    assert [e["label"] for e in tr.train_examples] == labels
    assert all(tr.prompt_ids(e) for e in tr.train_examples)


def test_datasetdict_without_a_split_names_the_splits(tmp_path):
    import datasets

    path = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(MATH),
                          "test": datasets.Dataset.from_list(GSM8K)}).save_to_disk(str(path))
    with pytest.raises(DatasetError, match=r"DatasetDict with splits train, test: name one"):
        Trainer(load_config(None, _ov(path, tmp_path / "run", task="math")))
    with pytest.raises(DatasetError, match=r"DatasetDict with splits train, test"):
        load_examples(str(path), "math")  # eval no longer picks `test` silently


def test_presample_reads_parquet_and_save_to_disk_folders(tmp_path):
    import datasets

    rows = [{"prompt": p + "=", "label": p[-1], "id": f"r{i}"} for i, p in enumerate(["ab", "cd", "ee", "fa"])]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    for path in (tmp_path / "t.parquet", tmp_path / "disk"):
        cfg = load_config(None, _ov(path, tmp_path / f"run-{path.name}", extra=["presample.n_pre=2", "presample.tau=1"]))
        s = presample(cfg, str(tmp_path / f"ps-{path.name}"), progress=False)
        assert s["complete"] and s["n_prompts"] == 4


def test_row_without_label_is_an_error_naming_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "ab=", "label": "b"}, {"prompt": "cd="}])
    with pytest.raises(DatasetError, match=r"t.jsonl:2: no label field"):
        Trainer(load_config(None, _ov(path, tmp_path / "run")))


@pytest.mark.parametrize("row, what", [
    ({"prompt": 123, "label": "a"}, "prompt field holds a int"),
    ({"prompt": {"x": 1}, "label": "a"}, "prompt field holds a dict"),
    ({"prompt": "ab=", "label": None}, "no label field"),
    ({"prompt": "ab=", "label": "b", "id": [1, 2]}, "id holds a list"),
    ({"prompt": "  ", "label": "b"}, "empty prompt"),
])
def test_wrong_field_types_are_errors_naming_file_and_line(row, what, tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "ab=", "label": "b"}, row])
    with pytest.raises(DatasetError, match=rf"t.jsonl:2: .*{what}"):
        Trainer(load_config(None, _ov(path, tmp_path / "run")))


def test_a_huge_prompt_is_refused_at_load_time_naming_its_line(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "ab=", "label": "b"}, {"prompt": "a" * 10_000_000, "label": "a"}])
    with pytest.raises(DatasetError, match=r"t.jsonl:2: prompt of 10,000,000 characters"):
        Trainer(load_config(None, _ov(path, tmp_path / "run")))
    # a prompt over the token limit (here set explicitly) is refused the same way
    path = _jsonl(tmp_path / "u.jsonl", [{"prompt": "ab=", "label": "b"}, {"prompt": "abc" * 20 + "=", "label": "a"}])
    with pytest.raises(DatasetError, match=r"u.jsonl:2: prompt is 61 tokens, more than data.max_prompt_tokens=40"):
        Trainer(load_config(None, _ov(path, tmp_path / "run2", extra=["data.max_prompt_tokens=40"])))


# ------------------------------------------------------------------ duplicate ids (issue 14 item 1)
def test_duplicate_ids_stop_training_with_both_lines(tmp_path):
    rows = [{"prompt": p + "=", "label": p[-1], "id": i} for p, i in (("ab", "x"), ("cd", "y"), ("ee", "x"))]
    path = _jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(DatasetError, match=r"t.jsonl:3: duplicate id 'x' .*first at .*t.jsonl:1"):
        Trainer(load_config(None, _ov(path, tmp_path / "run")))


def test_renamed_duplicates_each_train_on_their_own_prompt(tmp_path):
    # the old trainer cached prompt tokens by id: both "x" rows trained on the first one's prompt
    rows = [{"prompt": p + "=", "label": p[-1], "id": "x"} for p in ("ab", "cdd", "eeef")]
    path = _jsonl(tmp_path / "t.jsonl", rows)
    tr = Trainer(load_config(None, _ov(path, tmp_path / "run", extra=["data.duplicate_ids=rename"])))
    assert [e["id"] for e in tr.train_examples] == ["x", "x#1", "x#2"]
    assert [tr.tokenizer.decode(tr.prompt_ids(e)) for e in tr.train_examples] == ["ab=", "cdd=", "eeef="]


# ------------------------------------------------------------------ prompt template / system prompt
def test_prompt_template_and_system_prompt_from_the_config(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "ab=", "label": "b"}])
    tr = Trainer(load_config(None, _ov(path, tmp_path / "run", extra=["data.prompt_template=Q: {prompt} A:",
                                                                        "data.system_prompt=Be brief."])))
    want = "Be brief.\n\nQ: ab= A:\n"  # no chat template: plain messages
    assert render_prompt(tr.task, tr.tokenizer, tr.train_examples[0], tr.cfg.data) == want
    assert tr.prompt_ids(tr.train_examples[0]) == encode_prompts(tr.tokenizer, [want])[0]
    from openrlhf_div.tasks import get_task

    class ChatTok:
        chat_template = "x"

        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            return "|".join(f"{m['role']}:{m['content']}" for m in msgs) + "|assistant:"

    ex = {"prompt": "What is 1+1?", "label": "2"}
    assert render_example(get_task("math"), ChatTok(), ex, "Solve: {prompt}", "S") == \
        "system:S|user:Solve: What is 1+1?|assistant:"
    with pytest.raises(ConfigError, match="must contain"):
        load_config(None, _ov(path, tmp_path / "run", extra=["data.prompt_template=no placeholder"]))


# ------------------------------------------------------------------ real tokenizers
def test_no_pad_token_falls_back_to_eos_with_one_warning(caplog):
    model, tok = build_tiny_model(VOCAB, seed=0)
    tok.pad_token = None
    assert tok.pad_token_id is None
    with caplog.at_level(logging.WARNING):
        out = generate(model, tok, ["ab=", "c="], n_samples=2, max_new_tokens=4,
                       generator=torch.Generator().manual_seed(0))
        generate(model, tok, ["ab="], n_samples=1, max_new_tokens=2, generator=torch.Generator().manual_seed(0))
    assert len(out.texts) == 4 and tok.pad_token == tok.eos_token
    assert sum("no pad token" in r.getMessage() for r in caplog.records) == 1


def test_generation_stops_on_every_generation_config_eos_id():
    model, tok = build_tiny_model(VOCAB, seed=0)
    a = tok.convert_tokens_to_ids("a")
    model.generation_config.eos_token_id = [tok.eos_token_id, a]  # e.g. Llama-3's <|eot_id|>
    assert stop_token_ids(model, tok) == [tok.eos_token_id, a]
    out = generate(model, tok, ["ab=", "cd="], n_samples=16, max_new_tokens=12,
                   generator=torch.Generator().manual_seed(0))
    stopped_at_a = 0
    for ids in out.response_ids:
        assert a not in ids[:-1]  # nothing is generated after an end id
        stopped_at_a += ids[-1] == a
    assert stopped_at_a > 0


def test_bos_is_added_once_in_every_path():
    from tokenizers import processors

    model, tok = build_tiny_model(VOCAB, seed=0)
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    bos = tok.bos_token_id
    assert encode_text(tok, "ab=") == [bos] + tok("ab=", add_special_tokens=False)["input_ids"]
    assert encode_text(tok, "<bos>ab=")[:2] != [bos, bos]  # a template's own BOS is not doubled
    assert encode_prompts(tok, ["ab="])[0][0] == bos  # the training / presample / eval sampler path


# ------------------------------------------------------------------ no silent non-learning
def test_group_size_one_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.group_size=1.*all zero"):
        load_config(None, _ov("x.jsonl", tmp_path / "run", extra=["rollout.group_size=1"]))


def test_consecutive_degenerate_steps_stop_the_run_with_the_reason(tmp_path):
    # labels no response can match: every reward is 0, every advantage 0
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": p + "=", "label": "zz", "id": p} for p in ("ab", "cd", "ef")])
    tr = Trainer(load_config(None, _ov(path, tmp_path / "run", extra=["optim.steps=5",
                                                                       "optim.stop_after_degenerate_steps=2"])))
    with pytest.raises(DegenerateRunError, match=r"2 consecutive steps .*every reward was 0"):
        tr.train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["degenerate_step"] for r in rows] == [1.0, 1.0]
    assert rows[-1]["degenerate_groups_frac"] == 1.0 and rows[-1]["degenerate_steps_total"] == 2.0


def test_degenerate_counters_continue_across_a_resume(tmp_path):
    """Issue 30: after a resume ``degenerate_steps_total`` restarted from 0 and the stop counted
    consecutive steps from the resume on. Two degenerate steps, a checkpoint, a resume with a
    limit of 3: the third degenerate step (the first after the resume) stops the run."""
    from openrlhf_div.engines.local.trainer import train

    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": p + "=", "label": "zz", "id": p} for p in ("ab", "cd", "ef")])
    run = tmp_path / "run"
    Trainer(load_config(None, _ov(path, run, extra=["optim.stop_after_degenerate_steps=3"]))).train()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["degenerate_steps_total"] for r in rows] == [1.0, 2.0]
    with pytest.raises(DegenerateRunError, match=r"3 consecutive steps \(up to step 3\)"):
        train(resume=str(run), overrides=["optim.steps=6"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["degenerate_steps_total"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_anchor_method_with_empty_d_pef_stops_with_the_histogram(tmp_path):
    rows = [{"prompt": p + "=", "label": "zz", "id": p} for p in ("ab", "cd", "ef", "fa")]
    path = _jsonl(tmp_path / "t.jsonl", rows)
    ov = _ov(path, tmp_path / "run", extra=["presample.n_pre=2"])
    s = presample(load_config(None, ov), str(tmp_path / "ps"), progress=False)
    assert s["n_pef"] == 0
    with pytest.raises(EmptyAnchorError, match=r"holds no sample.*#correct histogram 0:4 1:0 2:0.*method.name=grpo"):
        Trainer(load_config(None, ov + ["method.name=dph_js", f"data.presample_dir={tmp_path / 'ps'}"]))



def test_gsm8k_answer_is_parsed_for_any_task(tmp_path):
    ex, _ = load_examples(str(_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)), "toy_copy")
    assert [e["label"] for e in ex] == ["42", "7", "1500"]
