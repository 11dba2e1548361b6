"""The CPU rehearsal of the GPU benchmark (``benchmarks/gpu_bench.sh``), so that a lent GPU only finds
GPU problems.

* the carry kit (``benchmarks/gpu_kit.py``): built (downloaded from PyPI once, then reused from
  ``.whl/`` while ``kit.json`` matches), every wheel's tags install on CPython 3.12 /
  manylinux x86_64 (``packaging.tags``, no network), one version each, kit + working tree
  <= 64 MiB; a wrong-tag wheel, a second version and an oversize kit are refused;
* every case of the bench runs at toy size on the CPU inside the *device view*: ``python -S`` with
  only the distributions of ``benchmarks/gpu_device_packages.txt`` and of the kit importable (and the
  standard-library modules Python 3.12 removed gone); every module imported comes from the
  standard library, the repository, the device list, the kit or our import stubs, and every kit
  distribution is imported by some case (nothing carried in vain);
* the shapes and the FLOP count the figures rest on.

Cost: the dry run is ~60 CPU-seconds (five cases in three processes; wall time grows with the
machine's load); building the kit the first time downloads ~10 MB and takes ~15 s.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "benchmarks")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load("gpu_bench")


@pytest.fixture(scope="module")
def kit_mod():
    return _load("gpu_kit")


@pytest.fixture(scope="module")
def kit(kit_mod):
    """The kit in .whl/ (built once, then cached); a clear failure when PyPI cannot be reached."""
    out = os.environ.get("GPU_BENCH_WHEELS", os.path.join(ROOT, ".whl"))
    try:
        kit_mod.build(out)
    except kit_mod.KitError as exc:
        pytest.fail(f"could not build the GPU carry kit (needs PyPI the first time, then cached in {out}):\n{exc}")
    return out


# ------------------------------------------------------------------ the script
def test_entry_point_parses_and_passes_shellcheck():
    script = os.path.join(SCRIPTS, "gpu_bench.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    exe = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
    if not os.path.exists(exe):
        pytest.skip("shellcheck not installed")
    r = subprocess.run([exe, script], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_gpu_run_refuses_without_cuda(tmp_path, bench):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_bench.sh"), "--results", str(tmp_path)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "--dry-run" in r.stderr
    assert bench.run_case(["logprobs"], False, str(tmp_path / "x.json"), None) == 2


# ------------------------------------------------------------------ shapes and FLOPs
@pytest.mark.parametrize("name,billions", [("qwen2.5-0.5b", 0.494), ("qwen2.5-1.5b", 1.544), ("qwen2.5-3b", 3.086)])
def test_shapes_are_the_released_models(bench, name, billions):
    """The config-built models have the released models' parameter counts (meta device: no memory)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**bench.SHAPES[name]))
    n = sum(p.numel() for p in model.parameters())   # tied embedding counted once
    assert n == bench.n_params(bench.SHAPES[name])
    assert n / 1e9 == pytest.approx(billions, rel=0.01)
    assert bench.SHAPES[name]["vocab_size"] == 151936


def test_flops_are_verls_count(bench):
    s = bench.SHAPES["qwen2.5-1.5b"]
    h, f, L, V, heads, kv = 1536, 8960, 28, 151936, 12, 2
    hd = h // heads
    dense = (h * (heads * hd + 2 * kv * hd + heads * hd) + 3 * h * f) * L + 2 * V * h
    assert bench.dense_params(s) == dense
    seqs = [1024, 300]
    want = 6 * dense * sum(seqs) + 12 * (1024 ** 2 + 300 ** 2) * hd * heads * L
    assert bench.train_flops(s, seqs) == pytest.approx(want, rel=1e-12)
    # the embedding and LM head are counted once each although Qwen2.5-1.5B ties them (verl does so)
    assert bench.dense_params(s) > bench.n_params(s)


def test_gpu_plan_is_the_issues_measurements(bench):
    gpu, dry = bench.plan(False), bench.plan(True)
    assert set(gpu) == set(dry) == set(bench.CASES)
    assert set(gpu["methods"]["methods"]) == {"grpo", "rkl", "dph_js", "dph_f", "ds_grpo", "lad_js", "clip_cov"}
    assert gpu["methods"]["shape"] == gpu["actor_step"]["shape"] == gpu["megatron"]["shape"] == "qwen2.5-1.5b"
    assert gpu["methods"]["warmup"] >= 1 and gpu["actor_step"]["warmup"] >= 1 and gpu["megatron"]["warmup"] >= 1
    assert gpu["logprobs"]["vocab"] == 151936
    assert gpu["largest"]["shapes"] == ["qwen2.5-3b", "qwen2.5-1.5b", "qwen2.5-0.5b"]
    # by its (unmeasured) estimates, the default run fits the default --budget-s of one 10-minute command
    assert sum(bench.ESTIMATE_S.values()) <= 540


# ------------------------------------------------------------------ the kit
def test_kit_installs_on_the_device_and_fits(kit, kit_mod):
    summary = kit_mod.check(kit)
    assert summary["total_mib"] <= 64
    for n in kit_mod.KIT:
        assert kit_mod.norm(n) in summary["wheels"], n
    with open(os.path.join(kit, "kit.json")) as fh:
        man = json.load(fh)
    assert man["python"] == "3.12"
    ds = [f for f in man["files"] if f.startswith("deepspeed-")]
    assert ds and ds[0].endswith("-py3-none-any.whl")  # the portable build, no compiled op
    assert kit_mod.cached(kit)  # a second build reuses the folder


def test_kit_check_refuses_what_would_not_install(kit, kit_mod, tmp_path):
    bad = tmp_path / "kit"
    shutil.copytree(kit, bad)
    (bad / "torchdata-0.11.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"x")
    (bad / "hjson-3.1.0-py3-none-win_amd64.whl").write_bytes(b"x")
    with pytest.raises(kit_mod.KitError) as e:
        kit_mod.check(str(bad))
    msg = str(e.value)
    assert "two versions of torchdata" not in msg or "hjson" in msg
    assert "win_amd64" in msg and "do not install on CPython 3.12" in msg
    assert "two versions of hjson" in msg
    with pytest.raises(kit_mod.KitError, match="over the 1 MiB"):
        kit_mod.check(kit, limit=2**20)


def test_device_package_list_is_the_device_notes(kit_mod):
    dev = kit_mod.device_packages()
    assert dev["torch"] == "2.11.0" and dev["transformers"] == "5.17.0" and dev["python"] == "3.12.3"
    for absent in ("vllm", "ray", "deepspeed", "megatron-core", "transformer-engine", "flash-attn", "openrlhf"):
        assert absent not in dev, absent
    assert not set(kit_mod.norm(k) for k in kit_mod.KIT) & set(dev)


# ------------------------------------------------------------------ the rehearsal
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, kit):
    out = tmp_path_factory.mktemp("gpu_bench_dry")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_bench.sh"), "--dry-run", "--results", str(out),
                        "--record-imports"], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    res = json.loads((out / "gpu_bench.json").read_text()) if (out / "gpu_bench.json").exists() else {}
    return r, res, out


def test_every_case_runs_on_cpu_in_the_device_view(dry_run, bench):
    r, res, out = dry_run
    failed = {n: c.get("error") or c.get("not_run") for n, c in res.get("cases", {}).items() if not c.get("ok")}
    assert r.returncode == 0 and not failed, (failed, r.stdout[-3000:], r.stderr[-3000:])
    cases = res["cases"]
    assert set(cases) == set(bench.CASES) and res["dry_run"]
    m = cases["methods"]["per_method"]
    assert set(m) == set(bench.METHODS)
    for name, row in m.items():
        assert row["step_s"] > 0 and row["fwd_bwd_s"] > 0 and row["generation_s"] > 0, name
        assert row["mfu"] > 0 and row["gen_tokens_per_s"] > 0 and row["train_tokens"] > 0, name
        assert row["vs_grpo"] > 0, name
    assert m["rkl"]["reference_model"] and not m["grpo"]["reference_model"]
    assert m["dph_js"]["anchor_rows"] and m["dph_f"]["anchor_rows"] and not m["lad_js"]["anchor_rows"]
    assert m["dph_js"]["train_tokens"] > m["grpo"]["train_tokens"]  # the anchor rows are trained on
    a = cases["actor_step"]
    assert a["stubs"] == {"flash_attn": True, "ray": True, "vllm": True}  # none of the three is on the GPU machine
    assert all(row["step_ms"] > 0 and row["mfu"] > 0 for row in a["per_method"].values())
    assert set(a["per_method"]) == {"grpo", "dph_js"}
    g = cases["megatron"]
    assert g["offload"]["state_bit_exact"] and g["logprob_vs_hf"]["max_abs"] < 0.05 and g["step_ms"] > 0
    assert g["plan_gib"]["total"] > 0
    lp = cases["logprobs"]["rows"]
    assert {(x["mode"], x["path"]) for x in lp} == {(mo, pa) for mo in ("train", "nograd")
                                                    for pa in ("full_logits", "from_hidden")}
    assert cases["largest"]["largest"] == "toy-l"
    md = (out / "gpu_bench.md").read_text()
    assert md.startswith(bench.BEGIN) and md.rstrip().endswith(bench.END) and "Dry run on a CPU" in md
    for name in bench.METHODS:
        assert f"| {name} | " in md


def test_every_import_is_on_the_device_or_carried(dry_run, kit_mod):
    _, res, out = dry_run
    records = {}
    for f in out.glob("imports_*.json"):
        for mod, src in json.loads(f.read_text()).items():
            records.setdefault(mod, set()).add(src)
    assert records, "the dry run recorded no imports"
    allowed = ("stdlib", "repo", "device:", "kit:", "stub", "in-memory")
    strays = {m: s for m, s in records.items() if not all(x.startswith(allowed) for x in s)}
    # __mp_main__ aliases the running script
    strays.pop("__mp_main__", None)
    assert not strays, strays
    assert {"ray", "vllm", "flash_attn"} <= {m for m, s in records.items() if "stub" in s}
    used = {src.split(":", 1)[1] for s in records.values() for src in s if src.startswith("kit:")}
    assert {kit_mod.norm(n) for n in kit_mod.KIT} <= {kit_mod.norm(u) for x in used for u in x.split(",")}, used


def test_report_refuses_a_dry_run_and_writes_a_gpu_result(dry_run, bench, tmp_path):
    _, res, out = dry_run
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\nbefore\n\n{bench.BEGIN}\nold\n{bench.END}\n\nafter\n")
    assert bench.main(["--report", str(out / "gpu_bench.json"), "--docs", str(docs)]) == 2
    gpu = dict(res, dry_run=False)
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    assert bench.main(["--report", str(tmp_path / "gpu.json"), "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "before" in text and "after" in text and "\nold\n" not in text
    assert text.count(bench.BEGIN) == 1 and "| grpo | " in text and "Dry run" not in text


def test_docs_hold_one_replaceable_section(bench):
    text = open(bench.DOCS).read()
    assert text.count(bench.BEGIN) == 1 and text.count(bench.END) == 1
    section = text[text.index(bench.BEGIN):text.index(bench.END)]
    if "| grpo | " not in section:   # no GPU result yet: the page must say so
        assert "Not run on a GPU yet" in section and "No GPU has run this yet" in text
