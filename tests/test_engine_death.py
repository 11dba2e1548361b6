"""A dead vLLM engine is named in one line (issue 29, item 3).

* the line itself: process, signal or exit code, likely cause, what to try;
* a real vLLM engine whose EngineCore process is killed from outside with SIGILL (what an AMX
  kernel without the permission does): the ``EngineDeadError`` the front end raises carries the
  line (so it also travels through a Ray actor to the job's driver), and :func:`explain` finds it
  in the exception chain, also wrapped the way Ray wraps a remote error;
* the CLI ends with that one line, and with one line for ``rollout.backend=vllm`` on a model vLLM
  cannot run (a traceback of ``BackendUnavailable`` before).
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from openrlhf_div.compat import engine_death


def test_lines_name_process_signal_cause_and_fix():
    line = engine_death.describe_exit("EngineCore_DP0", 123, -int(signal.SIGILL))
    assert "EngineCore_DP0 (pid 123) died from SIGILL" in line and "AMX" in line and "dtype float32" in line
    assert "out-of-memory" in engine_death.describe_exit("EngineCore_DP0", 1, -int(signal.SIGKILL))
    assert "Fatal Python error" in engine_death.describe_exit("EngineCore_DP0", 1, -int(signal.SIGSEGV))
    assert "exited with code 3" in engine_death.describe_exit("EngineCore_DP0", 1, 3)


def test_explain_reads_the_line_through_a_ray_style_wrapper():
    class RayTaskError(Exception):  # ray.exceptions.RayTaskError keeps the remote exception in .cause
        def __init__(self, cause):
            super().__init__("ray::LLMRayActor.generate() failed")
            self.cause = cause

    class EngineDeadError(Exception):
        pass

    inner = EngineDeadError(f"EngineCore encountered an issue. {engine_death.MARK}vLLM engine process X (pid 9) "
                            "died from SIGILL: illegal instruction]")
    assert engine_death.explain(RayTaskError(inner)).startswith("vLLM engine process X (pid 9) died from SIGILL")
    assert engine_death.explain(ValueError("bad option")) is None

    class ActorDiedError(Exception):  # a killed policy actor is no vLLM engine death
        pass

    assert engine_death.explain(RayTaskError(ActorDiedError("The actor died unexpectedly"))) is None
    generic = engine_death.explain(EngineDeadError("EngineCore encountered an issue."))
    assert generic and "not recorded" in generic


def test_a_dead_engines_line_outlives_its_manager_and_reaches_the_controller(monkeypatch):
    """vLLM drops a dead engine's process manager during its shutdown, and the controller of a Ray
    job asks the vLLM actors only after the step failed (``trainer._raise_naming_dead_engine``)."""
    import gc
    import weakref

    monkeypatch.setattr(engine_death, "_MANAGERS", weakref.WeakSet())
    monkeypatch.setattr(engine_death, "_SEEN", [])

    class Proc:
        name, pid, exitcode = "EngineCore", 77, -int(signal.SIGSEGV)

    class Manager:
        processes = [Proc()]

    m = Manager()
    engine_death._MANAGERS.add(m)
    want = [engine_death.describe_exit("EngineCore", 77, -int(signal.SIGSEGV))]
    assert engine_death.dead_engine_lines() == want
    del m
    gc.collect()
    assert len(engine_death._MANAGERS) == 0 and engine_death.dead_engine_lines() == want

    class Call:  # an actor handle's __ray_call__: runs the function in the actor (here: at once)
        def remote(self, fn):
            return fn(None)

    class Handle:
        __ray_call__ = Call()

    class Gone:  # an actor that died too
        @property
        def __ray_call__(self):
            raise RuntimeError("actor gone")

    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    assert engine_death.remote_dead_engine_lines([Gone(), Handle(), Handle()]) == want
    assert engine_death.remote_dead_engine_lines(None) == []


def test_killed_engine_core_is_named_in_the_error(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from vllm import LLM, SamplingParams

    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "fork",
                 "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
        monkeypatch.setenv(k, v)
    cfg = Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(tmp_path))
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=64)
    params = SamplingParams(max_tokens=2, detokenize=False)
    try:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        procs = llm.llm_engine.engine_core.resources.engine_manager.processes
        os.kill(procs[0].pid, signal.SIGILL)
        procs[0].join(timeout=30)
        time.sleep(1.5)  # vLLM's liveness monitor marks the engine dead
        with pytest.raises(Exception) as err:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        line = engine_death.explain(err.value)
        assert line and f"(pid {procs[0].pid}) died from SIGILL" in line and "AMX" in line, (line, repr(err.value))
        chain = [err.value, err.value.__cause__, err.value.__context__]
        assert any(engine_death.MARK in str(e) for e in chain if e is not None), repr(err.value)
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass


def test_cli_ends_with_one_line_when_vllm_cannot_run_the_model(capsys, tmp_path):
    from openrlhf_div.cli.main import main

    rc = main(["train", "--config", "configs/local_example.yaml", "rollout.backend=vllm", "optim.steps=1",
               f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert err[-1].lower().startswith("openrlhf-div train: error: rollout.backend=vllm but vllm cannot sample here: "
                                      "head size"), err
    assert "Traceback" not in "\n".join(err)
