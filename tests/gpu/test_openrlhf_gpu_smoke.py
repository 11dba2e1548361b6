"""A tiny end-to-end run of the OpenRLHF engine on one GPU (skipped without CUDA / vLLM).

A 2-layer Qwen2 built from a config, a toy "say t7" task with its reward-function file, one
rollout step of 4 prompts x 4 samples with vLLM colocated on the same GPU, for grpo (PPO-clip),
dph_f (D_pef anchors written here with the model's own log-probs), rkl (reference actor) and
lad_js. Checks: the driver exits 0, OpenRLHF logs a finished global step and the final model is
saved. Run: ``pytest tests/gpu -m gpu`` on a machine with a GPU and the docker image's stack.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow]
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (tests/gpu runs on a GPU machine)", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (see docker/Dockerfile)")
pytest.importorskip("ray")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V = 64

REWARD = textwrap.dedent('''
    import torch

    def reward_func(queries, prompts, labels, **kw):
        r = torch.tensor([1.0 if " t7" in q[len(p):] else 0.0 for q, p in zip(queries, prompts)])
        return {"rewards": r, "scores": r, "extra_logs": {}}
''')


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("gpu_smoke")
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model_dir = d / "model"
    model.save_pretrained(model_dir)
    hf_tok.save_pretrained(model_dir)
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"t{2 + i} t{3 + i} t4", "label": "t7"}) + "\n" for i in range(8)))
    (d / "reward.py").write_text(REWARD)
    # D_pef: one "correct" response per prompt with the base model's own per-token log-probs
    pef = []
    model.eval()
    for i in range(4):
        p = hf_tok(f"t{2 + i} t{3 + i} t4", add_special_tokens=False)["input_ids"]
        y = hf_tok("t7 t7", add_special_tokens=False)["input_ids"] + [1]
        ids = torch.tensor([p + y])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        pef.append({"id": f"p{i}", "prompt_text": f"t{2 + i} t{3 + i} t4", "label": "t7", "response": "t7 t7",
                    "prompt_ids": p, "response_ids": y, "ref_log_probs": lp[len(p) - 1:].tolist(),
                    "n_correct": 8, "n_pre": 8})
    (d / "pef").mkdir()
    (d / "pef" / "d_pef.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pef))
    return d


@pytest.mark.parametrize("method", ["grpo", "dph_f", "rkl", "lad_js"])
def test_tiny_end_to_end_step(workspace, method):
    d = workspace
    out = d / f"run_{method}"
    argv = [sys.executable, "-m", "openrlhf_div.cli.train_ppo_ray", "--div.method", method,
            "--actor.model_name_or_path", str(d / "model"), "--reward.remote_url", str(d / "reward.py"),
            "--data.prompt_dataset", str(d / "train.jsonl"), "--data.input_key", "prompt",
            "--data.label_key", "label", "--data.max_samples", "4", "--data.max_len", "64",
            "--rollout.max_new_tokens", "8", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4",
            "--rollout.micro_batch_size", "4", "--train.micro_batch_size", "4",
            "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1",
            "--vllm.tensor_parallel_size", "1", "--vllm.gpu_memory_utilization", "0.3", "--vllm.enforce_eager",
            "--train.colocate_all", "--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa",
            "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1",
            "--ckpt.output_dir", str(out / "model"), "--ckpt.path", str(out / "ckpt"), "--train.seed", "1"]
    if method == "dph_f":
        argv += ["--div.anchor_data", str(d / "pef"), "--div.anchor_batch_size", "4", "--train.batch_size", "20"]
    else:
        argv += ["--train.batch_size", "16"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    assert "Global step 1" in log, log[-3000:]
    assert (out / "model" / "config.json").exists()
    if method == "dph_f":
        assert "'rollout/num_anchor_samples': 4.0" in log
    if method == "rkl":
        assert "reference actor: yes" in log
