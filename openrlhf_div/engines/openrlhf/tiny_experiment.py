"""The tiny CPU experiment of ``configs/openrlhf/tiny_cpu_*.yaml``, built on first use (cached).

* :func:`build_tiny_model` builds a tiny Qwen2 (2 layers, head_dim 64, a word-level tokenizer
  over digits) taught single-digit sums for a few seconds so that its rollouts are sometimes
  right (rewards vary within a group).
* :func:`write_tiny_data` writes a small math data set (``{"prompt": "2 + 5 =", "answer": "7"}``).
* :func:`ensure` builds what is missing at the given paths and leaves what exists (a model is
  built in a temporary folder next to its target and renamed into place, so an interrupted
  build leaves nothing half-written; two runs racing build twice, one rename wins).

The launcher (``examples/scripts/run.sh``, through :mod:`openrlhf_div.engines.openrlhf.prepare`)
calls :func:`ensure` for a config with a ``tiny:`` section (``model:`` and ``data:`` paths); the
end-to-end test harness (``tests/e2e/ray_harness.build_tiny_experiment``) calls the same code.
Not a recipe for real training.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from typing import Dict, List, Optional

DIGITS = [str(i) for i in range(10)]
WORDS = ["+", "=", "and", "so", "is", "the", "sum"]
#: the file of the data folder the tiny configs read (``data.prompt_dataset``)
DATA_FILE = "train.jsonl"


def problems(rng: random.Random, n: int) -> List[Dict[str, str]]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        out.append({"prompt": f"{a} + {b} =", "answer": str(a + b)})
    return out


def build_tiny_model(path: str, *, seed: int = 0, warmup_steps: int = 40) -> str:
    """A 2-layer Qwen2 (hidden 128, 2 heads of 64, vocab 19) and its word-level tokenizer,
    taught ``a + b = c <eos>`` for ``warmup_steps`` Adam steps so sampling at T=1 gets a
    fraction of the sums right (rewards vary within a group). Saved in bf16 at ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1}
    for w in DIGITS + WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).float()  # taught in float32 (bf16 matmuls on CPU are slow), saved in bf16
        rng = random.Random(seed)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(warmup_steps):
            batch = [hf_tok(f"{p['prompt']} {p['answer']} <eos>")["input_ids"] for p in problems(rng, 16)]
            ids = torch.tensor(batch)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.config.dtype = "bfloat16"
    model.to(torch.bfloat16).save_pretrained(path)
    hf_tok.save_pretrained(path)
    return path


def write_tiny_data(data_dir: str, *, n_prompts: int = 8, seed: int = 0) -> str:
    """``data_dir/train.jsonl``: ``n_prompts`` sums (seed ``seed + 1``, as the e2e tests always had)."""
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, DATA_FILE)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        for p in problems(random.Random(seed + 1), n_prompts):
            fh.write(json.dumps(p) + "\n")
    os.replace(tmp, path)
    return path


def model_ready(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path))


def ensure(model: Optional[str] = None, data: Optional[str] = None, *, n_prompts: int = 8, seed: int = 0,
           say=None) -> Dict[str, str]:
    """Build the tiny model at ``model`` and the data at ``data`` (a folder) unless they exist.
    Returns ``{"model": ..., "data": <the .jsonl file>}`` (absolute paths) for what was asked."""
    out: Dict[str, str] = {}
    if model:
        model = os.path.abspath(model)
        if not (os.path.isdir(model) and model_ready(model)):
            if os.path.exists(model) and os.listdir(model):
                raise FileExistsError(f"{model} exists but holds no model (no config.json / *.safetensors); "
                                      "remove it or point the config's tiny.model elsewhere")
            if say:
                say(f"building the tiny model at {model} (first use; cached afterwards)")
            parent = os.path.dirname(model)
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".tiny_model_", dir=parent)
            try:
                build_tiny_model(tmp, seed=seed)
                if os.path.isdir(model) and not os.listdir(model):
                    os.rmdir(model)
                try:
                    os.rename(tmp, model)
                except OSError:
                    if not model_ready(model):  # lost a race to another build: theirs is complete
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        out["model"] = model
    if data:
        data = os.path.abspath(data)
        path = os.path.join(data, DATA_FILE)
        if not os.path.isfile(path):
            write_tiny_data(data, n_prompts=n_prompts, seed=seed)
        out["data"] = path
    return out
