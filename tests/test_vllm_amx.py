"""Every process that runs a vLLM CPU engine asks for the AMX permission before its first forward
(issue 29: on Intel Xeons with AMX, vLLM 0.29's bf16 attention takes its ``amx`` kernels and, in a
process that never asked, dies with SIGILL).

The request comes from our ``vllm.general_plugins`` entry point (setup.py ->
``openrlhf_div.compat.vllm_plugin.register``), which vLLM loads in each of its processes. Each
scenario is a fresh Python process (the permission, and the plugin's record of it, belong to a
process) running ``tests/vllm_cpu_attn.py``: on a CPU without AMX the attention ISA is forced to
``amx`` and a stand-in that refuses to run in a process without the request replaces the kernel
(on an AMX CPU the real kernel runs), so these tests fail on *this* machine whenever an engine
process would die on an AMX one:

* in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the local sampler, evaluation);
* EngineCore forked (vLLM's default on CPU) and spawned (what vLLM does inside a Ray actor,
  OpenRLHF's rollout engines and our pre-sampling on Ray);
* the guard itself: with our plugin left out (``VLLM_PLUGINS`` naming only vLLM's own), the same
  forced engine is refused -- the failure an AMX CPU turns into SIGILL.
* ``vec16`` (head size 48) runs for real on any x86 CPU.

Cost: four engine processes, ~20 s each on the 2-core machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "vllm_cpu_attn.py")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    sys.path.insert(0, HERE)
    import vllm_cpu_attn as A

    base = tmp_path_factory.mktemp("amx_models")
    return {"bf16": A.save_model(str(base / "bf16_hd64")), "hd48": A.save_model(str(base / "f32_hd48"), head_dim=48,
                                                                                  dtype="float32")}


def _run(scenario, model, dtype, **env):
    full = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1",
                VLLM_ALLOW_INSECURE_SERIALIZATION="1", **env)
    proc = subprocess.run([sys.executable, SCRIPT, scenario, model, dtype], capture_output=True, text=True,
                          env=full, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            return json.loads(line[len("REPORT "):])
        if line.startswith("FAILED "):
            return {"failed": json.loads(line[len("FAILED "):])}
    raise AssertionError(f"scenario {scenario} printed no report (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _assert_amx_engine(rep, *, engine_in_other_process: bool):
    assert "failed" not in rep, rep.get("failed")
    assert rep["isa"] and set(rep["isa"].values()) == {"amx"}, rep["isa"]  # every layer took the AMX kernels
    assert rep["amx"]["requested"], rep["amx"]  # ... in a process that asked for AMX first
    assert rep["used"].get("amx") in ("kernel", "stand-in"), rep["used"]
    assert (rep["amx"]["pid"] != rep["front_pid"]) == engine_in_other_process, rep
    assert all(len(t) == 8 for t in rep["tokens"]), rep["tokens"]


def test_in_process_engine_requests_amx_before_amx_attention(models):
    rep = _run("amx", models["bf16"], "bfloat16", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    _assert_amx_engine(rep, engine_in_other_process=False)


def test_forked_engine_core_has_the_permission(models):
    rep = _run("amx", models["bf16"], "bfloat16", VLLM_ENABLE_V1_MULTIPROCESSING="1",
               VLLM_WORKER_MULTIPROC_METHOD="fork")
    _assert_amx_engine(rep, engine_in_other_process=True)


def test_spawned_engine_core_requests_it_itself(models):
    """A spawned EngineCore inherits nothing: the plugin must have run in that process (its own
    pid), as in a Ray actor. No forcing here (a spawned child does not see this test's patches):
    this CPU's own ISA runs, and the request is checked directly."""
    rep = _run("plain", models["bf16"], "bfloat16", VLLM_ENABLE_V1_MULTIPROCESSING="1",
               VLLM_WORKER_MULTIPROC_METHOD="spawn")
    assert "failed" not in rep, rep.get("failed")
    assert rep["amx"]["pid"] != rep["front_pid"] and rep["amx"]["plugin_pid"] == rep["amx"]["pid"], rep
    assert rep["amx"]["requested"], rep["amx"]
    expected = "amx" if rep["amx"]["supported"] else "vec"
    assert set(rep["isa"].values()) == {expected}, rep["isa"]


def test_without_the_plugin_amx_attention_is_refused(models):
    """The guard: the same forced engine with our plugin excluded is refused (SIGILL on AMX)."""
    rep = _run("amx", models["bf16"], "bfloat16", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_PLUGINS="lora_filesystem_resolver")
    if not rep.get("failed") and rep.get("used", {}).get("amx") == "kernel":
        pytest.skip("this CPU has AMX and something else granted the permission")
    assert "failed" in rep and any("AMXPermissionMissing" in c for c in rep["failed"]), rep


def test_head_size_48_takes_vec16_for_real(models):
    rep = _run("plain", models["hd48"], "float32", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert "failed" not in rep, rep.get("failed")
    assert set(rep["isa"].values()) == {"vec16"}, rep["isa"]
    assert rep["amx"]["requested"]
