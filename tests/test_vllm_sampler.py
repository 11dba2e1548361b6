"""``rollout.backend``: the choice between the hf sampler and the in-process vLLM engine, and
the vLLM engine itself next to a trainer (weights pushed after the optimizer step reach the
sampler, its log-probs match the trainer's forward, same seed gives the same samples).

Cost (``--durations``, this 2-core machine): the selection tests never import vLLM (their time
is importing transformers when they run first in a process). The engine test imports vLLM
(~10-15 s), starts one in-process engine and runs one RL step of a 2-layer model, twice: with
``enforce_eager`` (~5 s start; 25-32 s at load average ~5, 68 s at ~15) and compiled (vLLM's
inductor compile of the tiny model, ~25 s here with an empty cache; ~45 s in all when idle): a
compiled graph must not keep the weights (or oneDNN handles) it was compiled with.
"""
import copy
import importlib.util
import sys

import pytest
import torch

from openrlhf_div.engines.local.config import ConfigError, load_config
from openrlhf_div.engines.local.tiny import build_tiny_model
from openrlhf_div.engines.local.toy import VOCAB, make_examples
from openrlhf_div.engines.local.sampler_registry import SamplerUnavailable, resolve_backend
from openrlhf_div.engines.local.vllm_sampler import vllm_unsupported_reason
from openrlhf_div.io import atomic_write_jsonl

# float32 on CPU, a 2-layer model: vLLM's kernels (its own attention, fused qkv / gate_up GEMMs)
# against the trainer's HF forward; measured max |difference| ~1e-6
LOGPROB_TOL = 1e-4


# ------------------------------------------------------------------------------ selection
def test_engine_config_folder_ignores_where_the_weights_came_from(tmp_path, monkeypatch):
    """The vLLM model folder (and so vLLM's compile-cache key) depends on the architecture, not on
    ``_name_or_path``: the same model read from another path reuses the compiled graph."""
    from openrlhf_div.engines.local.vllm_sampler import _config_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, _ = build_tiny_model(VOCAB, seed=0)
    a, b = copy.deepcopy(model.config), copy.deepcopy(model.config)
    a._name_or_path, b._name_or_path = "/venv1/cache/gguf/model-1111", "/venv2/cache/gguf/model-2222"
    assert _config_dir(a) == _config_dir(b)
    assert "_name_or_path" not in open(f"{_config_dir(a)}/config.json").read()
    b.num_hidden_layers += 1  # another architecture: another folder
    assert _config_dir(b) != _config_dir(a)


def test_backend_selection_without_importing_vllm(monkeypatch):
    imported_before = "vllm" in sys.modules
    lines = []
    tiny16, _ = build_tiny_model(VOCAB, seed=0)  # hidden 64 / 4 heads: head size 16
    assert resolve_backend("hf", tiny16, "cpu", log=lines.append) == "hf" and lines == []
    assert resolve_backend("auto", tiny16, "cpu", log=lines.append) == "hf"
    assert len(lines) == 1 and "head size 16" in lines[0] and "rollout.backend=auto" in lines[0]
    with pytest.raises(SamplerUnavailable, match="head size 16.*rollout.backend=auto or hf"):
        resolve_backend("vllm", tiny16, "cpu")
    with pytest.raises(ValueError, match="auto, hf, vllm"):
        resolve_backend("sglang", tiny16, "cpu")

    tiny32, _ = build_tiny_model(VOCAB, seed=0, num_heads=2, num_kv_heads=1)  # head size 32
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    assert vllm_unsupported_reason(tiny32, "cpu") == "vllm is not installed"
    lines.clear()
    assert resolve_backend("auto", tiny32, "cpu", log=lines.append) == "hf"
    assert lines and "vllm is not installed" in lines[0]
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)

    tiny32.peft_config = {"default": object()}  # what peft puts on a LoRA model
    assert "LoRA" in vllm_unsupported_reason(tiny32, "cpu", check_registry=False)
    del tiny32.peft_config
    assert vllm_unsupported_reason(tiny32, "meta", check_registry=False).startswith("device meta")
    assert ("vllm" in sys.modules) == imported_before  # every decision above was made without importing vLLM


def test_auto_falls_back_to_hf_when_the_engine_does_not_start(monkeypatch):
    from openrlhf_div.engines.local import sampler_registry, vllm_sampler

    def boom(*a, **kw):
        raise ValueError("bfloat16 is not supported on this CPU")

    monkeypatch.setattr(vllm_sampler, "VLLMSampler", boom)
    lines = []
    auto = load_config(None, ["task=toy_copy"]).rollout
    s = sampler_registry.build_sampler("vllm", None, None, auto, device="cpu", seed=0, fallback="hf", log=lines.append)
    assert s.name == "hf"
    assert len(lines) == 1 and "did not start (ValueError: bfloat16 is not supported" in lines[0]
    assert sampler_registry.build_sampler("hf", None, None, auto, device="cpu", seed=0).name == "hf"
    explicit = load_config(None, ["task=toy_copy", "rollout.backend=vllm"]).rollout
    with pytest.raises(ValueError, match="bfloat16"):
        sampler_registry.build_sampler("vllm", None, None, explicit, device="cpu", seed=0)


def test_inductor_aot_artifacts_can_finish_loading():
    """vLLM 0.29's AOT reload calls ``compiled_fn.finalize_loading(vllm_config)``; on CPU the compiled
    function is torch's Inductor wrapper, which lacked it (openrlhf_div/compat/vllm_aot_cache.py)."""
    wrap = pytest.importorskip("torch._dynamo.aot_compile_types")
    from openrlhf_div.compat.vllm_aot_cache import allow_inductor_aot_reload

    class Compiled:  # what deserialize_bundled_cache_entry hands the wrapper: a callable with serialize
        serialize = None

        def __call__(self, x):
            return x + 1

    assert allow_inductor_aot_reload() is True
    f = wrap.BundledAOTAutogradSerializableCallable(Compiled())
    f.finalize_loading(object())  # before the fix: AttributeError via __getattr__ on the wrapped function
    assert f(1) == 2
    assert allow_inductor_aot_reload() is True  # idempotent


def test_backend_config_validation():
    assert load_config(None, ["task=toy_copy"]).rollout.backend == "auto"
    with pytest.raises(ConfigError, match="rollout.backend must be one of auto, hf, vllm"):
        load_config(None, ["task=toy_copy", "rollout.backend=trt"])
    with pytest.raises(ConfigError, match="rollout.vllm_seeding must be batch or request, got 'row'"):
        load_config(None, ["task=toy_copy", "rollout.vllm_seeding=row"])
    with pytest.raises(ConfigError, match="top_p < 1 needs rollout.backend=hf"):
        load_config(None, ["task=toy_copy", "rollout.recompute_old_log_probs=false", "rollout.top_p=0.9"])
    load_config(None, ["task=toy_copy", "rollout.recompute_old_log_probs=false", "rollout.top_p=0.9",
                       "rollout.backend=hf"])


# ------------------------------------------------------------------------------ the engine
def _trainer_log_probs(model, gen):
    from openrlhf_div.engines.local.generation import sequence_log_probs

    with torch.no_grad():
        return sequence_log_probs(model, gen.input_ids, gen.attention_mask, gen.response_mask)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_vllm_sampler_follows_the_trainer(tmp_path, eager):
    from openrlhf_div.engines.local.trainer import Trainer

    atomic_write_jsonl(str(tmp_path / "train.jsonl"), make_examples(32, seed=1))
    cfg = load_config(None, [
        "task=toy_copy", f"output_dir={tmp_path}/run", f"model.tiny_vocab={VOCAB}", "model.tiny_heads=2",
        "model.tiny_kv_heads=1", f"data.train={tmp_path}/train.jsonl", "rollout.prompts_per_step=8",
        "rollout.group_size=8", "rollout.max_new_tokens=8", "rollout.backend=vllm", "rollout.vllm_kv_cache_gb=0.1",
        "optim.learning_rate=3e-2", "eval.at_start=false", "logging.tensorboard=false", "logging.progress=false",
        "checkpoint.every=0", "num_threads=1", f"rollout.vllm_enforce_eager={str(eager).lower()}"])
    tr = Trainer(cfg)
    try:
        assert tr.backend == "vllm"
        prompts = [tr.prompt_ids(ex) for ex in tr.train_examples[:4]]

        def draw(seed):
            g = torch.Generator().manual_seed(seed)
            return tr.sample(prompts, n_samples=4, max_new_tokens=8, temperature=1.0, top_p=1.0, generator=g)

        assert tr.sampler.seeding == "batch"  # the default: one seed per call for vLLM's batched sampler
        rng = torch.get_rng_state()
        a = draw(7)
        assert torch.equal(torch.get_rng_state(), rng)  # the trainer's own random state is untouched
        # the sampler's log-probs are the trainer's forward on the same tokens
        assert float((a.log_probs - _trainer_log_probs(tr.model, a)).abs().max()) < LOGPROB_TOL
        if eager:  # seeding (the compiled engine's test is whether weight updates reach its graph, below)
            tr.sample(prompts[:2] + [prompts[0][:-1]], n_samples=3, max_new_tokens=8, temperature=1.0, top_p=1.0,
                      generator=torch.Generator().manual_seed(1))  # another call in between (a warm prefix cache)
            b = draw(7)
            assert a.response_ids == b.response_ids and torch.equal(a.log_probs, b.log_probs)  # same seed, same samples
            assert draw(8).response_ids != a.response_ids
            tr.sampler.seeding = "request"  # every sample its own seeded request
            r7 = draw(7)
            assert r7.response_ids == draw(7).response_ids and draw(8).response_ids != r7.response_ids
            assert float((r7.log_probs - _trainer_log_probs(tr.model, r7)).abs().max()) < LOGPROB_TOL
            tr.sampler.seeding = "batch"

        before = copy.deepcopy(tr.model).eval()
        stats = tr.train_step()
        assert stats["time_weight_sync"] > 0
        moved = max(float((p - q).abs().max()) for p, q in zip(tr.model.parameters(), before.parameters()))
        assert moved > 1e-3
        c = draw(7)
        # after the step: the sampler scores with the new weights, not the old ones
        assert float((c.log_probs - _trainer_log_probs(tr.model, c)).abs().max()) < LOGPROB_TOL
        assert float((c.log_probs - _trainer_log_probs(before, c)).abs().max()) > 100 * LOGPROB_TOL
    finally:
        tr.close_sampler()
    with pytest.raises(RuntimeError, match="the vLLM sampler was closed"):
        draw(7)
    if not eager:  # a second start of the same model loads the compiled graph instead of compiling again
        from vllm.compilation.counter import compilation_counter

        from openrlhf_div.engines.local.vllm_sampler import VLLMSampler

        loaded = compilation_counter.num_aot_artifacts_loaded
        again = VLLMSampler(tr.model, tr.tokenizer, kv_cache_gb=0.1, enforce_eager=False)
        try:
            assert compilation_counter.num_aot_artifacts_loaded == loaded + 1
            c2 = again.generate(prompts, n_samples=4, max_new_tokens=8, generator=torch.Generator().manual_seed(7))
            assert float((c2.log_probs - _trainer_log_probs(tr.model, c2)).abs().max()) < LOGPROB_TOL
        finally:
            again.close()
