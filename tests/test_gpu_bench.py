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
* nothing measured is lost: a case killed after its second row (a fault injected through
  ``GPU_BENCH_FAULT``) leaves its first two rows in the results and the rest marked "not reached"
  with the reason; the results folder holds at most 8 files (JSON, table, full log, import
  records), at most 2 levels deep;
* the shapes and the FLOP count the figures rest on, the order and the estimates of the cases.

Cost: the dry run is ~60 CPU-seconds (six cases in three processes; wall time grows with the
machine's load); the fault run ~15 s; building the kit the first time downloads ~10 MB and takes ~15 s.
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
    assert r.returncode == 2 and "no CUDA device" in r.stdout and "--dry-run" in r.stdout
    assert "no CUDA device" in (tmp_path / "gpu_bench.log").read_text()  # the log says it too
    assert bench.run_case(["logprobs"], False, str(tmp_path / "x.json"), None) == 2


# ------------------------------------------------------------------ shapes and FLOPs
@pytest.mark.parametrize("name,billions", [("qwen2.5-0.5b", 0.494), ("qwen2.5-1.5b", 1.544), ("qwen2.5-3b", 3.086),
                                           ("qwen2.5-7b", 7.616)])
def test_shapes_are_the_released_models(bench, name, billions):
    """The config-built models have the released models' parameter counts (meta device: no memory)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**bench.SHAPES[name]))
    n = sum(p.numel() for p in model.parameters())   # tied embedding counted once
    assert n == bench.n_params(bench.SHAPES[name])
    assert n / 1e9 == pytest.approx(billions, rel=0.01)
    assert bench.SHAPES[name]["vocab_size"] == (152064 if name == "qwen2.5-7b" else 151936)


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
    assert set(gpu) == set(dry) == set(bench.CASES) == set(bench.GUESS_S)
    assert set(gpu["methods"]["methods"]) == {"grpo", "rkl", "dph_js", "dph_f", "ds_grpo", "lad_js", "clip_cov"}
    assert gpu["methods"]["shape"] == gpu["actor_step"]["shape"] == gpu["megatron"]["shape"] == "qwen2.5-1.5b"
    assert gpu["methods"]["warmup"] >= 1 and gpu["actor_step"]["warmup"] >= 1 and gpu["megatron"]["warmup"] >= 1
    assert gpu["logprobs"]["vocab"] == 151936
    assert gpu["largest"]["shapes"] == ["qwen2.5-7b", "qwen2.5-3b", "qwen2.5-1.5b", "qwen2.5-0.5b"]   # 7B first
    # by its (unmeasured) estimates, the default run fits the default budget of one 10-minute command
    # with 10% to spare
    assert sum(bench.GUESS_S[n] for n in bench.CASES) <= (1 - bench.SLACK) * bench.DEFAULT_BUDGET_S
    assert bench.SLACK >= 0.10
    # what only a GPU can prove runs first (after the seconds-long GEMM peak): the FusedAdam build,
    # Megatron on CUDA, the log-prob kernels; the local engine's methods and the largest model after
    assert bench.CASES == ("gemm", "actor_step", "megatron", "logprobs", "decode", "methods", "largest")
    # the decode step with and without the CUDA graph (issue 41 item 6): 64 rows of the 1.5B shape
    assert gpu["decode"]["steps"] == ["dynamic", "static", "graph"] and gpu["decode"]["shape"] == "qwen2.5-1.5b"
    assert gpu["decode"]["prompts"] * gpu["decode"]["group"] == 64 and gpu["decode"]["warmup"] >= 1
    for name in bench.CASES:   # every timed case measures after a warm-up, more than once
        if "steps" in gpu[name]:
            assert gpu[name]["warmup"] >= 1, name
    assert gpu["methods"]["steps"] >= 3 and gpu["actor_step"]["steps"] >= 3 and gpu["megatron"]["steps"] >= 3


def _proportions(name, p):
    """The ratios a toy-size rehearsal must keep from the real shapes (issue 41: a hard-coded 256-token
    log-prob batch was all prompt at prompt 256, never at the dry run's toy sizes)."""
    if name == "actor_step":
        return {"prompt/seq": p["prompt"] / p["seq"], "micro-batches": p["batch"] // p["micro"]}
    if name == "megatron":
        return {"prompt/seq": p["prompt"] / p["seq"], "lp_seq/seq": p["lp_seq"] / p["seq"],
                "n_micro/micro": p["n_micro"] / p["micro"]}
    if name == "decode":
        return {"prompt/new": p["prompt_len"] / p["new_tokens"], "group": p["group"] / p["prompts"]}
    if name in ("methods", "largest"):
        return {"prompt/new": p["prompt_len"] / p["new_tokens"],
                "micro-batches": p["prompts"] * p["group"] // p["micro"]}
    return {}


@pytest.mark.parametrize("name", ["actor_step", "megatron", "decode", "methods", "largest"])
def test_dry_run_keeps_the_real_shapes_proportions(bench, name):
    gpu, dry = bench.plan(False)[name], bench.plan(True)[name]
    assert _proportions(name, dry) == _proportions(name, gpu)
    if name == "megatron":   # the log-prob comparison has responses to compare, in both
        for p in (gpu, dry):
            assert p["prompt"] < p["lp_seq"] <= p["seq"]


def test_masked_reductions_refuse_an_empty_mask():
    import torch

    from openrlhf_div.algorithms._utils import masked_agreement, masked_max

    x = torch.randn(2, 5)
    empty = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="log-probs vs HF: the mask selects none of its 10 positions"):
        masked_agreement(x, x + 1, empty, "log-probs vs HF")
    with pytest.raises(ValueError, match="selects none"):
        masked_max(x, empty, "x")
    m = torch.zeros(2, 5)
    m[:, 3:] = 1
    got = masked_agreement(x, x + torch.arange(5.0), m, "d")
    assert got == {"mean_abs": pytest.approx(3.5), "max_abs": pytest.approx(4.0), "n": 4}


def test_commit_is_the_checkouts_own_or_unknown(tmp_path):
    """A plain copy of the checkout (no .git) inside another repository reports "unknown", not the
    enclosing repository's commit (the first GPU run's report named the wrong one)."""
    from openrlhf_div.engines.local.runlog import own_commit

    outer = tmp_path / "outer"
    copy = outer / "copy"
    (copy / "benchmarks").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q", str(outer)], check=True)
    (outer / "f").write_text("x")
    subprocess.run([*git, "-C", str(outer), "add", "f"], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-qm", "outer"], check=True)
    outer_head = subprocess.run(["git", "-C", str(outer), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    shutil.copy(os.path.join(SCRIPTS, "gpu_bench.py"), copy / "benchmarks" / "gpu_bench.py")
    code = "import sys; sys.argv=['x']; import gpu_bench; print(gpu_bench.environment()['commit'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=copy / "benchmarks", env=dict(os.environ, PYTHONPATH=f"{copy / 'benchmarks'}:{ROOT}"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "unknown" != outer_head
    assert own_commit(str(copy)) is None and own_commit(str(outer), short=True) == outer_head
    assert own_commit(ROOT) or not os.path.exists(os.path.join(ROOT, ".git"))   # this checkout: its own


def test_measured_case_times_replace_the_guesses(bench, tmp_path):
    assert bench.estimates(str(tmp_path / "none.json"))["methods"]["source"].startswith("guess")
    (tmp_path / "m.json").write_text(json.dumps({"device": "NVIDIA H100", "date": "2026-11-27",
                                                 "cases": {"methods": {"wall_s": 97.5, "ok": True}}}))
    est = bench.estimates(str(tmp_path / "m.json"))
    assert est["methods"] == {"s": 97.5, "source": "measured on NVIDIA H100 (2026-11-27)"}
    assert est["megatron"]["s"] == bench.GUESS_S["megatron"]


def test_figures_carry_n_min_median_max(bench):
    assert bench.stats([3.0, 1.0, 2.0]) == {"n": 3, "min": 1.0, "median": 2.0, "max": 3.0}
    assert bench.stats([]) is None
    assert bench._fs(bench.stats([3.0, 1.0, 2.0])) == "2.00 (1.00-3.00, n=3)"


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
    assert "win_amd64" in msg and "do not install on cp312" in msg
    assert "two versions of hjson" in msg
    with pytest.raises(kit_mod.KitError, match="over the 1 MiB"):
        kit_mod.check(kit, limit=2**20)


def test_device_package_list_is_an_example_of_the_repository(kit_mod):
    text = open(kit_mod.EXAMPLE_PACKAGES).read()
    assert "/work/" not in text and "pip list --format freeze" in text   # nothing outside the repository
    dev = kit_mod.device_packages()
    assert dev["torch"] == "2.11.0" and dev["transformers"] == "5.17.0" and dev["python"] == "3.12.3"
    for absent in ("vllm", "ray", "deepspeed", "megatron-core", "transformer-engine", "flash-attn", "openrlhf"):
        assert absent not in dev, absent
    assert not set(kit_mod.norm(k) for k in kit_mod.KIT) & set(dev)


def test_kit_targets_the_given_package_list_and_python_tag(kit_mod, tmp_path, monkeypatch):
    """A target described by its `pip list --format freeze` and its tag: the kit carries only what
    that target lacks, and a bad tag or a missing list is refused in one line."""
    monkeypatch.setattr(kit_mod, "DEVICE_PACKAGES", kit_mod.DEVICE_PACKAGES)
    monkeypatch.setattr(kit_mod, "PYTHON_TAG", kit_mod.PYTHON_TAG)
    monkeypatch.setattr(kit_mod, "DEVICE_PYTHON", kit_mod.DEVICE_PYTHON)
    # recorded, so that the values set_target exports are removed again after the test
    monkeypatch.setenv("GPU_KIT_TARGET_PACKAGES", kit_mod.EXAMPLE_PACKAGES)
    monkeypatch.setenv("GPU_KIT_PYTHON_TAG", "cp312")
    lst = tmp_path / "packages.txt"
    lst.write_text("torch==2.11.0\ntransformers==5.17.0\nhjson==3.1.0\npydantic==2.12.0\n")
    kit_mod.set_target(str(lst), "cp311")
    assert kit_mod.DEVICE_PYTHON == (3, 11) and os.environ["GPU_KIT_PYTHON_TAG"] == "cp311"
    carried = {kit_mod.norm(s.split("==")[0]) for s in kit_mod.kit_spec()}
    assert "hjson" not in carried and "pydantic" not in carried and "deepspeed" in carried
    assert any(str(t).startswith("cp311-cp311-manylinux") for t in kit_mod.device_tags())
    with pytest.raises(kit_mod.KitError, match="--python-tag 'py3'"):
        kit_mod.set_target(None, "py3")
    with pytest.raises(kit_mod.KitError, match="pip list --format freeze"):
        kit_mod.set_target(str(tmp_path / "missing.txt"), None)


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
    assert res["order"] == list(bench.CASES)
    plan = bench.plan(True)
    m = cases["methods"]["rows"]
    assert list(m) == list(bench.METHODS)
    for name, row in m.items():
        for k in ("step_s", "fwd_bwd_s", "generation_s", "gen_tokens_per_s", "train_tokens"):
            st = row[k]
            assert st["n"] == plan["methods"]["steps"] and 0 < st["min"] <= st["median"] <= st["max"], (name, k)
        assert row["mfu"] > 0 and row["mfu_gemm"] > 0 and row["warmup_steps"] == 1, name
    assert m["rkl"]["reference_model"] and not m["grpo"]["reference_model"]
    assert m["dph_js"]["anchor_rows"] and m["dph_f"]["anchor_rows"] and not m["lad_js"]["anchor_rows"]
    assert m["dph_js"]["train_tokens"]["median"] > m["grpo"]["train_tokens"]["median"]  # anchor rows are trained on
    gemm = cases["gemm"]["tflops_max"]
    assert gemm > 0 and cases["gemm"]["rows"]["bf16_gemm"]["tflops"]["n"] == plan["gemm"]["repeats"]
    a = cases["actor_step"]
    assert a["stubs"] == {"flash_attn": True, "ray": True, "vllm": True}  # none of the three is on the GPU machine
    assert list(a["rows"]) == ["grpo", "dph_js"]
    for row in a["rows"].values():
        assert row["step_ms"]["n"] == plan["actor_step"]["steps"] and row["step_ms"]["median"] > 0
        assert row["mfu"] > 0 and row["mfu_gemm"] == pytest.approx(row["mfu"] * cases["actor_step"]["peak_tflops"]
                                                                     / gemm, rel=1e-6)
    g = cases["megatron"]["rows"]
    assert g["offload"]["state_bit_exact"] and g["logprob_vs_hf"]["max_abs"] < 0.05
    assert g["train_step"]["step_ms"]["median"] > 0 and g["train_step"]["plan_gib"]["total"] > 0
    lp = cases["logprobs"]["rows"]
    assert set(lp) == {f"{mo}/{n}/{pa}" for n in plan["logprobs"]["tokens"] for mo in ("train", "nograd")
                       for pa in ("full_logits", "from_hidden")}
    assert all(r["ms"]["n"] == plan["logprobs"]["repeats"] for r in lp.values())
    dc = cases["decode"]["rows"]
    assert list(dc) == plan["decode"]["steps"] == ["dynamic", "static"]   # no CUDA graph on a CPU
    for row in dc.values():
        assert row["step_ms"]["n"] == plan["decode"]["repeats"] and row["step_ms"]["median"] > 0
        assert 0 < row["gen_tokens"] <= plan["decode"]["prompts"] * plan["decode"]["group"] * plan["decode"]["new_tokens"]
    assert dc["static"]["vs"] == "dynamic" and dc["static"]["rows_same_tokens"].endswith("/16")
    assert cases["largest"]["largest"] == "toy-l" and cases["largest"]["rows"]["toy"] == {"not_needed": "toy-l trains"}
    # DIR is all that comes back: at most 8 files, 2 levels, the full log among them
    files = [f for f in out.rglob("*") if f.is_file()]
    assert len(files) <= 8 and all(len(f.relative_to(out).parts) <= 2 for f in files), files
    log = (out / "gpu_bench.log").read_text()
    assert "pre-flight" in log and "[gpu_bench] largest: ok" in log and "wrote" in log
    md = (out / "gpu_bench.md").read_text()
    assert md.startswith(bench.BEGIN) and md.rstrip().endswith(bench.END) and "Dry run on a CPU" in md
    for name in bench.METHODS:
        assert f"| {name} | " in md
    assert "MFU vs GEMM" in md and "n=2" in md
    assert "| static | " in md and "Lean decoder, token step per `decode_step`" in md


def test_a_case_killed_midway_keeps_its_first_rows(bench, tmp_path):
    """Fault injected after the second row of ``methods``: the process dies (SIGKILL, as at a time
    limit); rows 1-2 are in the results, the other five are "not reached" with the reason."""
    out = tmp_path / "res"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GPU_BENCH_FAULT="methods:2")
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_bench.py"), "--dry-run", "--results", str(out),
                        "--cases", "methods,gemm"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    res = json.loads((out / "gpu_bench.json").read_text())
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert res["order"] == ["methods", "gemm"]
    m = res["cases"]["methods"]
    rows = m["rows"]
    assert list(rows) == list(bench.METHODS)
    for name in bench.METHODS[:2]:
        assert rows[name]["step_s"]["n"] == 2 and rows[name]["step_s"]["median"] > 0, rows[name]
    for name in bench.METHODS[2:]:
        assert rows[name] == {"not_reached": "the case process died (signal 9) after 2 of 7 rows"}, rows[name]
    assert not m["ok"] and m["partial"]
    # a dry run shares one process between these two cases: the one after is not reached either
    # (on a GPU every case has its own process)
    assert res["cases"]["gemm"]["rows"] == {"bf16_gemm": {
        "not_reached": "the case process died (signal 9) after 0 of 1 rows"}}
    md = (out / "gpu_bench.md").read_text()
    assert "| grpo | " in md and "| rkl | " in md and "| dph_js | not reached: the case process died" in md
    assert not list(out.glob(".case_*"))


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
    measured = tmp_path / "measured.json"
    assert bench.main(["--report", str(out), "--docs", str(docs), "--measured", str(measured)]) == 2
    gpu = dict(res, dry_run=False)
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "gpu_bench.json").write_text(json.dumps(gpu))
    assert bench.main(["--report", str(tmp_path / "gpu"), "--docs", str(docs), "--measured", str(measured)]) == 0
    text = docs.read_text()
    assert "before" in text and "after" in text and "\nold\n" not in text
    assert text.count(bench.BEGIN) == 1 and "| grpo | " in text and "Dry run" not in text
    est = bench.estimates(str(measured))   # the run's case times replace the guesses
    assert est["methods"]["s"] == pytest.approx(res["cases"]["methods"]["wall_s"], abs=0.1)
    assert est["methods"]["source"].startswith("measured")


def test_benchmarks_import_nothing_from_tests():
    """No benchmark or script puts tests/ on sys.path; the package has no module only a benchmark uses."""
    import re

    for folder in ("benchmarks", "scripts"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith((".py", ".sh")):
                    text = open(os.path.join(dirpath, f)).read()
                    for line in text.splitlines():
                        assert not ("sys.path" in line and "tests" in line), (f, line)
                        assert not ("spec_from_file_location" in line and "tests" in line), (f, line)
                    assert not re.search(r"^\s*(from|import) (tests|cpu_seams|mcore_cpu)\b", text, re.M), f
    assert not os.path.exists(os.path.join(ROOT, "openrlhf_div", "compat", "ray_stub.py"))


def test_docs_hold_one_replaceable_section(bench):
    text = open(bench.DOCS).read()
    assert text.count(bench.BEGIN) == 1 and text.count(bench.END) == 1
    section = text[text.index(bench.BEGIN):text.index(bench.END)]
    if "| grpo | " not in section:   # no GPU result yet: the page must say so
        assert "Not run on a GPU yet" in section and "No GPU has run this yet" in text
