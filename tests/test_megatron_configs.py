"""configs/megatron/*.yaml, their launchers, the --megatron.* flags and the memory model.

Each config must parse into a valid MegatronConfig, describe a layout OpenRLHF accepts
(colocated vLLM GPUs = actor GPUs, actor GPUs a multiple of tp * pp, anchors filling whole
optimiser steps), shard Qwen2.5-32B evenly, and fit 80 GB GPUs by the documented memory model;
the single-node layout without the host optimiser must not fit (the reason it uses one).
"""
import argparse
import glob
import os
import shutil
import subprocess

import pytest

from openrlhf_div.engines.megatron import add_megatron_arguments, megatron_config_from_args
from openrlhf_div.engines.megatron import memory_plan as MM  # openrlhf-div plan-memory
from openrlhf_div.engines.megatron.config import MegatronConfig
from openrlhf_div.engines.openrlhf.launch import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN25_32B, estimate_memory, expected_mfu = MM.QWEN25_32B, MM.estimate_memory, MM.expected_mfu
flops_per_token, total_params, with_tp = MM.flops_per_token, MM.total_params, MM.with_tp
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "megatron", "[!_]*.yaml")))  # _*.yaml: family bases
SECTIONS = {"experiment", "description", "paper", "task", "method", "div", "layout", "openrlhf", "cluster", "presample", "toy", "notes"}
GPU_GIB = 79.0   # usable memory of an 80 GB H100 / A100


def _parse(flags):
    p = argparse.ArgumentParser()
    add_megatron_arguments(p)
    argv = []
    for k, v in flags.items():
        if k.startswith("megatron."):
            if v is True:
                argv.append(f"--{k}")
            elif v is not False:
                argv += [f"--{k}", str(v)]
    ns = p.parse_args(argv)
    return megatron_config_from_args(ns)


def test_there_are_eight_configs():
    names = {os.path.basename(c) for c in CONFIGS}
    for m in ("grpo", "dapo", "dph_f", "dph_js"):
        for lay in ("tp8", "2node"):
            assert f"omnisql32b_bird_{m}_megatron_{lay}.yaml" in names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_layout(path):
    cfg = load_config(path)   # extends resolved: the family base + layout + method lines
    assert set(cfg) <= SECTIONS
    div, method, flags, cluster = cfg["div"], cfg["method"], cfg["openrlhf"], cfg["cluster"]
    assert div["actor_backend"] == "megatron"
    assert method["name"] in os.path.basename(path)
    mcfg = _parse(flags)
    assert mcfg.tp == 8 and mcfg.sp and mcfg.recompute == "full"
    gpus = flags["actor.num_nodes"] * flags["actor.num_gpus_per_node"]
    assert gpus % mcfg.model_parallel_size == 0
    dp = mcfg.data_parallel_size(gpus)
    assert flags["train.colocate_all"] and flags["ds.enable_sleep"] and flags["vllm.enable_sleep"]
    assert flags["vllm.num_engines"] * flags["vllm.tensor_parallel_size"] == gpus   # OpenRLHF's colocation rule
    assert cluster["nodes"] * cluster["gpus_per_node"] >= gpus
    online = flags["rollout.batch_size"] * flags["rollout.n_samples_per_prompt"]
    rows = online + int(div.get("anchor_batch_size", 0) or 0)
    if method.get("aggregation") == "micro-batch-token-mean":  # the authors' layout: anchors in a trailing step
        assert online % flags["train.batch_size"] == 0
    else:
        assert rows % flags["train.batch_size"] == 0
    assert flags["train.batch_size"] % (flags["train.micro_batch_size"] * dp) == 0
    assert ("anchor_data" in div) == method["name"].startswith("dph")
    if "presample" in cfg:      # the Megatron reference scores D_pef: its GPUs hold whole TP x PP replicas
        pre = {**flags, **{k: v for k, v in cfg["presample"].items() if "." in k}}
        ref = _parse(pre)
        ref_gpus = pre["ref.num_nodes"] * pre["ref.num_gpus_per_node"]
        assert ref_gpus % ref.model_parallel_size == 0
        assert pre["vllm.num_engines"] * pre["vllm.tensor_parallel_size"] + ref_gpus <= gpus   # not colocated
        assert 2 * total_params(QWEN25_32B) / ref.tp / 2 ** 30 < GPU_GIB / 2
    with_tp(QWEN25_32B, mcfg.tp).check_tp(mcfg.tp)
    seq = flags["data.max_len"]
    mem = estimate_memory(QWEN25_32B, mcfg, dp, seq, micro_batch=MM.config_micro_batch(cfg)).as_gib()
    assert mem["total"] < GPU_GIB - 10, mem      # >= 10 GiB headroom by the model
    assert not flags.get("ds.packing_samples", False)
    # the figures the config states are the memory model's, and every phase fits with headroom
    assert {k: cluster[k] for k in MM.CONFIG_KEYS} == MM.config_figures(cfg)
    plan = MM.config_plan(cfg)
    assert plan["gpu_peak_gib"] < GPU_GIB - 10, plan
    assert plan["gpu_fit_gib"] == pytest.approx(mem["total"])


def test_single_node_needs_the_host_optimizer():
    base = dict(tp=8, pp=1, sp=True, recompute="full")
    on_gpu = estimate_memory(QWEN25_32B, MegatronConfig(**base), dp=1, seq_len=6144).as_gib()
    host = estimate_memory(QWEN25_32B, MegatronConfig(**base, optimizer_cpu_offload=True), dp=1, seq_len=6144)
    assert on_gpu["total"] > GPU_GIB - 10         # fails the 10 GiB headroom every config keeps
    assert host.as_gib()["total"] < 40
    P = host.params_per_gpu
    # megatron-core's hybrid optimizer: fp32 master + Adam m, v on the host, fp32 grads pinned
    assert host.host_optimizer == pytest.approx(12 * P) and host.host_pinned_grads == pytest.approx(4 * P)
    assert host.optimizer == 0 and host.host_pinned_master == 0
    # without use_precision_aware_optimizer the distributed optimizer keeps fp32 main params on
    # the GPU (+4 B/param, ~15 GiB at TP 8) and the host copy of them is pinned
    legacy = estimate_memory(QWEN25_32B, MegatronConfig(**base, optimizer_cpu_offload=True), dp=1, seq_len=6144,
                             precision_aware=False)
    assert legacy.optimizer == pytest.approx(4 * P) and legacy.host_pinned_master == pytest.approx(4 * P)
    assert 14 < (legacy.total - host.total) / MM.GiB < 16
    two = estimate_memory(QWEN25_32B, MegatronConfig(**base), dp=2, seq_len=6144).as_gib()
    assert two["optimizer"] == pytest.approx(on_gpu["optimizer"] / 2)


def test_host_memory_per_node():
    """1 node, host optimizer: 8 x 16 B/param of optimizer on the host + two sleeping vLLM engines'
    bf16 weights; 2 nodes: the offloaded GPU optimizer state (pinned) + the same vLLM copies."""

    one = load_config(os.path.join(ROOT, "configs", "megatron", "omnisql32b_bird_grpo_megatron_tp8.yaml"))
    two = load_config(os.path.join(ROOT, "configs", "megatron", "omnisql32b_bird_grpo_megatron_2node.yaml"))
    p1, p2 = MM.config_plan(one), MM.config_plan(two)
    P = p1["params_per_gpu_B"] * 1e9
    vllm = 2 * 2 * total_params(QWEN25_32B) / MM.GiB           # 2 engines per node x bf16 model
    assert p1["host_vllm_per_node_gib"] == pytest.approx(vllm)
    assert p1["host_per_node_gib"] == pytest.approx(8 * 16 * P / MM.GiB + vllm)
    assert p1["pinned_host_per_node_gib"] == pytest.approx(8 * 4 * P / MM.GiB + vllm)
    assert p2["host_per_node_gib"] == pytest.approx(8 * 6 * P / MM.GiB + vllm)      # 12 B/param / DP 2
    assert p2["pinned_host_per_node_gib"] == pytest.approx(p2["host_per_node_gib"])


def test_memory_model_bookkeeping():
    n = total_params(QWEN25_32B)
    assert 32.5e9 < n < 33.0e9                      # Qwen2.5-32B: 32.8B parameters
    m = estimate_memory(QWEN25_32B, MegatronConfig(tp=8, sp=True, recompute="full"), dp=1, seq_len=4096)
    assert m.params_per_gpu * 8 == pytest.approx(n, rel=0.01)     # vocabulary padding only
    assert m.weights == pytest.approx(2 * m.params_per_gpu) and m.grads == pytest.approx(4 * m.params_per_gpu)
    no_sp = estimate_memory(QWEN25_32B, MegatronConfig(tp=8, sp=False, recompute="full"), dp=1, seq_len=4096)
    assert no_sp.act_checkpoints == pytest.approx(8 * m.act_checkpoints)
    f = flops_per_token(QWEN25_32B, 4096)
    assert 6 * n * 0.95 < f < 6 * n * 1.15
    mfu = expected_mfu(MegatronConfig(tp=8, recompute="full"), 6144)["mfu"]
    assert 0.3 < mfu < 0.6


def test_flag_errors_are_clear():
    p = argparse.ArgumentParser()
    add_megatron_arguments(p)
    with pytest.raises(ValueError, match="sequence parallel"):
        megatron_config_from_args(p.parse_args(["--megatron.sp"]))
    with pytest.raises(ValueError, match="distributed optimizer"):
        megatron_config_from_args(p.parse_args(["--megatron.optimizer_cpu_offload",
                                                "--megatron.no_distributed_optimizer"]))
    with pytest.raises(ValueError, match="multiple of tp"):
        MegatronConfig(tp=8, pp=2).validate(world_size=8 * 3)
    with pytest.raises(ValueError, match="unknown"):
        megatron_config_from_args(argparse.Namespace(megatron={"tq": 2}))


def test_the_launcher_finds_every_megatron_experiment():
    """examples/scripts/run.sh EXPERIMENT resolves every configs/megatron experiment by name (one
    launcher for all; the 24 per-config train/submit wrappers are gone), and refuses a base."""
    names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "configs", "megatron", "[!_]*.yaml")))
    assert len(names) == 12  # 8 spec-form + 4 authors'-code configs
    common = os.path.join(ROOT, "examples", "scripts", "_common.sh")
    script = f"source {common}; for n in {' '.join(names)} _omnisql32b_bird_megatron; do experiment_config $n || echo MISSING $n; done"
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert r.stdout.split() == [os.path.join(ROOT, "configs", "megatron", f"{n}.yaml") for n in names] + \
        ["MISSING", "_omnisql32b_bird_megatron"], r.stdout + r.stderr
    run = os.path.join(ROOT, "examples", "scripts", "run.sh")
    subprocess.run(["bash", "-n", run], check=True)
    assert os.access(run, os.X_OK)
    sc = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(os.sys.executable))
    if sc:
        subprocess.run([sc, "-x", run, common, os.path.join(ROOT, "examples", "scripts", "sweep_methods.sh")],
                       check=True, cwd=ROOT)


def test_flags_through_openrlhf_hierarchize():
    from openrlhf_div.engines.megatron import uses_megatron

    hierarchize = pytest.importorskip("openrlhf.utils.config").hierarchize
    p = argparse.ArgumentParser()
    add_megatron_arguments(p)
    ns = hierarchize(p.parse_args(["--div.actor_backend", "megatron", "--megatron.tp", "4", "--megatron.pp", "2",
                                   "--megatron.recompute", "selective"]))
    assert uses_megatron(ns)
    m = megatron_config_from_args(ns)
    assert (m.tp, m.pp, m.recompute, m.model_parallel_size) == (4, 2, "selective", 8)
    q = argparse.ArgumentParser()
    q.add_argument("--div.actor_backend", default="deepspeed")      # the driver's own flag wins
    add_megatron_arguments(q)
    assert not uses_megatron(hierarchize(q.parse_args([])))


def test_plan_memory_is_a_command(capsys):
    """`openrlhf-div plan-memory --config X` prints the plan the config's cluster section states."""
    from openrlhf_div.cli.main import main

    path = CONFIGS[0]
    assert main(["plan-memory", "--config", path]) == 0
    out = capsys.readouterr().out
    figures = MM.config_figures(load_config(path))
    assert "cluster section:" in out and all(f"{k}: {v}" in out for k, v in figures.items()), out
    assert main(["plan-memory", "--tp", "8", "--dp", "2"]) == 0
    assert "tp=8 pp=1 dp=2" in capsys.readouterr().out
