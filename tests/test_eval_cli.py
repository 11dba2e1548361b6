"""`openrlhf-div eval` end to end with a tiny Hugging Face model built offline, plus the HF and
(stand-in) vLLM samplers."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from openrlhf_div.cli.main import main  # noqa: E402
from openrlhf_div.engines.local.samplers import generate, make_generate_fn  # noqa: E402

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def build_tiny_model(path):
    """A 2-layer Qwen2 (hidden 64) with a byte-level BPE tokenizer trained on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The answer is \\boxed{42}.", "Please reason step by step", "What is 1 + 1? 2", "SELECT * FROM t"] * 5
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
                      bos_token_id=fast.eos_token_id, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def loaded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def manual_greedy(model, tok, prompt, steps):
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(ids).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tok.decode(new, skip_special_tokens=True)


def test_hf_greedy_matches_a_manual_argmax_decode_and_padding_is_harmless(loaded):
    model, tok = loaded
    prompts = ["What is 1 + 1?", "The answer is"]  # different lengths: left padding in the batch
    out = generate(model, tok, prompts, n=3, max_new_tokens=6, greedy=True, batch_size=2)
    assert [len(g) for g in out] == [3, 3] and all(len(set(g)) == 1 for g in out)
    assert [g[0] for g in out] == [manual_greedy(model, tok, p, 6) for p in prompts]


def test_hf_sampling_shape_and_seed(loaded):
    model, tok = loaded
    torch.manual_seed(1)
    a = generate(model, tok, ["What is", "SELECT"], n=4, temperature=1.0, top_p=0.9, max_new_tokens=4, batch_size=2)
    torch.manual_seed(1)
    b = generate(model, tok, ["What is", "SELECT"], n=4, temperature=1.0, top_p=0.9, max_new_tokens=4, batch_size=2)
    assert a == b and [len(g) for g in a] == [4, 4] and all(isinstance(s, str) for g in a for s in g)
    assert len(set(a[0])) > 1  # a random tiny model samples different strings
    with pytest.raises(ValueError, match="temperature"):
        generate(model, tok, ["x"], n=2, temperature=0.0)


def test_eval_command_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "run1"
    rc = main(["eval", "--model", model_dir, "--task", "math", "--data", os.path.join(FIX, "math", "math500.jsonl"),
               "--data", os.path.join(FIX, "math", "aime24.jsonl"), "--n", "4", "--k", "1,2,4", "--temperature", "1.0",
               "--top-p", "0.95", "--greedy", "--max-new-tokens", "6", "--batch-size", "4", "--sampler", "hf",
               "--limit", "2",
               "--out", str(out), "--no-progress", "--task-opt", "timeout=2", "--task-opt", "num_workers=2",
               "--role", "base"])
    assert rc == 0
    data = json.load(open(out / "eval.json"))
    assert data["format"] == "openrlhf-div.eval/2" and data["role"] == "base" and data["seed"] is None
    assert set(data["by_source"]) == {"math500", "aime24", "all"}
    assert data["by_source"]["math500"]["problems"] == 2 and data["by_source"]["aime24"]["problems"] == 2
    for m in data["by_source"].values():
        for key in ("pass@1", "pass@2", "pass@4", "mean@4", "greedy", "dist-1", "dist-2", "distinct_correct"):
            assert 0.0 <= m[key] <= (4 if key == "distinct_correct" else 1.0), key
    # per-problem records are consistent with the reported numbers
    probs = data["problems"]
    assert len(probs) == 4 and all(len(p["correct"]) == 4 and p["n_correct"] == sum(p["correct"]) for p in probs)
    mean4 = sum(sum(p["correct"]) for p in probs if p["source"] == "aime24") / 8
    assert data["by_source"]["aime24"]["mean@4"] == pytest.approx(mean4)
    assert data["settings"]["engine"] == "hf" and data["info"]["task_options"] == {"timeout": 2, "num_workers": 2}
    assert [d["loaded"] for d in data["info"]["data"]] == [2, 2]
    assert data["settings"]["max_new_tokens"] == 6 and data["settings"]["grading"].startswith("math")
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(samples) == 4 and all(len(s["responses"]) == 4 for s in samples)
    md = open(out / "results.md").read()
    assert "| math500 | 2 |" in md and "| aime24 | 2 |" in md and "pass@4" in md and "greedy" in md
    assert "| math500 | 2 |" in capsys.readouterr().out

    # a second run against the first as the "base model": other n, max_new_tokens and data are refused,
    # naming the differences (they used to be mixed silently) ...
    out2 = tmp_path / "run2"
    args = ["eval", "--model", model_dir, "--task", "math", "--data", os.path.join(FIX, "math", "aime24.jsonl"),
            "--n", "2", "--k", "1", "--max-new-tokens", "4", "--sampler", "hf", "--out", str(out2),
            "--no-progress", "--base-results", str(out), "--keep-k", "2", "--top-p", "0.95",
            "--task-opt", "timeout=2", "--task-opt", "num_workers=2"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "n: base=4, this run=2" in err and "max_new_tokens: base=6, this run=4" in err and "data_hash" in err
    assert "--allow-mismatch" in err and not out2.exists()
    # ... unless allowed, and then recorded
    rc = main(args + ["--allow-mismatch"])
    assert rc == 0
    data2 = json.load(open(out2 / "eval.json"))
    assert data2["role"] == "trained" and any("max_new_tokens" in d for d in data2["info"]["settings_mismatch"])
    m = data2["by_source"]["aime24"]
    assert m["problems"] == 3 and m["keep_explore_problems"] == 2  # the base run saw 2 of the 3
    assert "keep_rate" in m and "explore_rate" in m


def test_eval_command_errors(model_dir, tmp_path, capsys):
    data = os.path.join(FIX, "math", "aime24.jsonl")
    assert main(["eval", "--model", model_dir, "--task", "math", "--data", data, "--n", "4", "--k", "1,8"]) == 2
    assert "exceed --n 4" in capsys.readouterr().err
    assert main(["eval", "--model", model_dir, "--task", "maths", "--data", data]) == 2
    assert "Did you mean 'math'" in capsys.readouterr().err
    assert main(["eval", "--model", model_dir, "--task", "math", "--data",
                 os.path.join(FIX, "math", "malformed.jsonl")]) == 2
    assert "malformed.jsonl:2: invalid JSON" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "nope"), "--task", "math", "--data", data]) == 2
    assert "does not exist" in capsys.readouterr().err
    # sql without db_root: a clear error before any generation
    assert main(["eval", "--model", model_dir, "--task", "sql", "--data", os.path.join(os.path.dirname(os.path.dirname(FIX)), "examples", "data", "toy_sql", "spider_dev.json"),
                 "--sampler", "hf", "--n", "1", "--k", "1", "--no-progress", "--role", "base"]) == 2
    assert "db_root" in capsys.readouterr().err


def test_vllm_engine_is_the_registry_sampler_on_the_model_train_loads(model_dir, monkeypatch):
    """``--engine vllm`` loads the model through the one loading path (``load_pretrained``: a folder, a
    ``.gguf`` file, a Hub id) and hands it to the sampler registry's ``vllm`` entry, the in-process
    engine training uses (started from the loaded model's config, weights pushed). A stand-in entry
    stands for vLLM here (the real one: tests/test_real_model.py on the SmolLM2 GGUF,
    tests/test_vllm_sampler.py on a tiny model). Before the seam, eval built its own ``vllm.LLM`` from
    the path, which could not read a .gguf file (issue 30, defect 10)."""
    from openrlhf_div.engines.local import sampler_registry as reg

    seen = {}

    class StandIn(reg.HFSampler):
        name = "vllm"

    def factory(model, tokenizer, rollout_cfg, *, device, seed):
        seen.update(model=model, eager=rollout_cfg.vllm_enforce_eager, device=device, seed=seed)
        return StandIn(model, tokenizer)

    monkeypatch.setitem(reg._REGISTRY, "vllm", reg.SamplerSpec("vllm", factory, lambda m, d: None, "stand-in"))
    monkeypatch.setattr("openrlhf_div.engines.local.samplers.vllm_available", lambda: True)
    fn, tok, engine = make_generate_fn(model_dir, engine="vllm", device="cpu", seed=3, vllm_enforce_eager=True)
    assert engine == "vllm" and tok.eos_token == "<eos>" and seen["eager"] is True and seen["seed"] == 3
    disk = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    for (k, a), b in zip(seen["model"].state_dict().items(), disk.state_dict().values()):
        assert torch.equal(a, b), k  # the loaded model's weights reach the sampler
    out = fn(["What is", "SELECT"], n=3, temperature=0.6, top_p=0.95, max_new_tokens=4)
    assert [len(g) for g in out] == [3, 3] and all(isinstance(c, str) and c.truncated is not None for g in out for c in g)
    assert [len(g) for g in fn(["a"], n=2, greedy=True)] == [2]
    # a model vLLM cannot take: one line naming why and the engines that can
    monkeypatch.setitem(reg._REGISTRY, "vllm", reg.SamplerSpec("vllm", factory, lambda m, d: "head size 16", "x"))
    with pytest.raises(RuntimeError, match=r"^--sampler vllm: vLLM cannot sample .* here: head size 16; use --sampler "
                                           r"local or hf$"):
        make_generate_fn(model_dir, engine="vllm", device="cpu")


def test_eval_defaults_to_the_engine_sampler_and_samples_carry_everything(model_dir, tmp_path):
    out = tmp_path / "run"
    rc = main(["eval", "--model", model_dir, "--task", "math", "--data", os.path.join(FIX, "math", "math500.jsonl"),
               "--n", "2", "--k", "1", "--max-new-tokens", "5", "--limit", "2", "--out", str(out), "--no-progress",
               "--task-opt", "timeout=2", "--task-opt", "num_workers=1", "--role", "base"])
    assert rc == 0
    assert json.load(open(out / "eval.json"))["settings"]["engine"] == "local"  # vllm is not installed here
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    for s in samples:
        assert s["prompt"] and len(s["responses"]) == 2
        for key in ("answers", "rewards", "reasons", "correct", "truncated"):
            assert len(s[key]) == 2, key
        assert all(isinstance(t, bool) for t in s["truncated"])
    # 5 tokens are too few for this random model to end: at least one sample is marked truncated
    assert any(t for s in samples for t in s["truncated"])


def test_eval_role_is_explicit_or_read_from_a_train_run_folder(model_dir, tmp_path, capsys):
    """Issue 39 defect 6: following compare's hint (`openrlhf-div eval --model RUN/final_model ...
    --out DIR`) evaluated a trained model as `role: base` by default, and the report then said "RL
    raises pass@1 over the base: NO". A model inside a train run folder is `trained` (with the run's
    seed); a model of unknown provenance needs --role; every hint printing an eval command names it."""
    import shutil

    from openrlhf_div.eval.results import load_run

    run = tmp_path / "runs" / "grpo"
    shutil.copytree(model_dir, run / "final_model")
    (run / "run_info.json").write_text(json.dumps({"seed": 5, "engine": "local", "experiment": None,
                                                   "method": {"name": "dph_js"}}))
    common = ["--task", "math", "--data", os.path.join(FIX, "math", "math500.jsonl"), "--n", "2", "--k", "1",
              "--max-new-tokens", "3", "--limit", "1", "--sampler", "hf", "--no-progress", "--task-opt", "timeout=2",
              "--task-opt", "num_workers=1"]
    out = tmp_path / "ev_trained"
    assert main(["eval", "--model", str(run / "final_model"), *common, "--out", str(out)]) == 0
    d = json.load(open(out / "eval.json"))
    assert d["role"] == "trained" and d["seed"] == 5 and d["info"]["run_dir"] == str(run) and d["name"] == "dph_js"
    assert d["info"]["eval_seed"] == 0  # the sampling seed is not passed off as a training seed
    # compare reads the run's seed and engine through the recorded run folder
    prov = load_run(str(out))["_provenance"]
    assert (prov["seed"], prov["engine"], prov["settings"]) == (5, "local", None)
    # a model of unknown provenance: refused in one line naming --role
    capsys.readouterr()
    assert main(["eval", "--model", model_dir, *common, "--out", str(tmp_path / "ev_unknown")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and "--role base" in err[0] and "--role trained" in err[0], err
    assert not (tmp_path / "ev_unknown").exists()
    assert main(["eval", "--model", model_dir, *common, "--out", str(tmp_path / "ev_base"), "--role", "base"]) == 0
    b = json.load(open(tmp_path / "ev_base" / "eval.json"))
    assert b["role"] == "base" and b["seed"] is None
    # compare's hint for a train run folder without eval.json names the role
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.yaml").write_text("task: math\n")
    with pytest.raises(FileNotFoundError, match=r"openrlhf-div eval --model .* --role trained --out"):
        load_run(str(tmp_path / "bare"))


def test_eval_sampler_flag_and_its_old_name(capsys):
    """Issue 42 item 3: "engine" is the trainer; eval's sampler is --sampler, the old --engine reads as it
    with one line. Mutation: the old flag's note removed -> this fails."""
    from openrlhf_div.cli.main import build_parser

    p = build_parser()
    assert p.parse_args(["eval", "--model", "m", "--task", "math", "--data", "d.jsonl", "--sampler", "hf"]).engine == "hf"
    assert capsys.readouterr().err == ""
    assert p.parse_args(["eval", "--model", "m", "--task", "math", "--data", "d.jsonl", "--engine", "local"]).engine == "local"
    assert "eval --engine is spelt --sampler now" in capsys.readouterr().err


def test_eval_takes_the_schemas_names_as_key_value(model_dir, tmp_path, capsys):
    """Issue 42: one override syntax on every command. eval's settings the schema owns are also
    ``key=value`` in the schema's names (as on run/train), anywhere on the line; the two spellings give
    the same evaluation. Mutation: apply_settings not called in run -> this fails."""
    data = os.path.join(FIX, "math", "aime24.jsonl")
    common = ["--sampler", "hf", "--no-progress", "--role", "base", "--task-opt", "timeout=2"]
    assert main(["eval", "--model", model_dir, "--task", "math", "--data", data, "--n", "2", "--k", "1,2",
                 "--temperature", "0.7", "--max-new-tokens", "4", "--limit", "2", "--seed", "3",
                 "--out", str(tmp_path / "flags")] + common) == 0
    assert main(["eval", f"model.path={model_dir}", "task=math", f"data.eval={data}", "eval.n_samples=2"] + common
                + ["eval.k=1,2", "eval.temperature=0.7", "eval.max_new_tokens=4", "eval.max_prompts=2", "seed=3",
                   "--out", str(tmp_path / "keys")]) == 0
    a, b = (json.load(open(tmp_path / d / "eval.json")) for d in ("flags", "keys"))
    assert a["settings"] == b["settings"] and a["settings"]["n"] == 2 and a["settings"]["temperature"] == 0.7
    assert a["by_source"] == b["by_source"]
    capsys.readouterr()
    assert main(["eval", "--model", model_dir, "--task", "math", "--data", data, "--n", "2", "eval.n_samples=4"]) == 2
    assert "eval.n_samples and --n are one setting given twice" in capsys.readouterr().err
    assert main(["eval", "--model", model_dir, "--task", "math", "--data", data, "eval.nsamples=4"]) == 2
    assert "Did you mean eval.n_samples" in capsys.readouterr().err
    assert main(["eval", "--model", model_dir, "--task", "math"]) == 2
    assert "--data (or data.eval=...) required" in capsys.readouterr().err
    assert main(["eval", "--model", model_dir, "--task", "math", "--data", data, "--nn", "3"]) == 2
    assert "unrecognized argument '--nn'" in capsys.readouterr().err
