"""Output that reads well in a file: progress as plain lines (no carriage-return redraws) when
the output is not a terminal, and no DeepSpeed accelerator warning on local CPU runs."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from openrlhf_div.progress import LineProgress, progress_bar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_line_progress_prints_every_few_percent_or_seconds():
    buf, clock = io.StringIO(), _Clock()
    bar = LineProgress(total=100, desc="train grpo", unit="step", stream=buf, every_percent=25, every_seconds=60,
                       clock=clock)
    for i in range(100):
        clock.t += 0.1
        bar.set_postfix(loss=f"{i:.1f}")
        bar.update(1)
    bar.close()
    lines = buf.getvalue().splitlines()
    assert "\r" not in buf.getvalue()
    assert [line.split(" ")[2] for line in lines] == ["25/100", "50/100", "75/100", "100/100"]
    assert lines[-1].startswith("train grpo: 100/100 (100%) 10.0 s, 10 step/s, loss=99.0")
    # time also triggers a line: 1 step a minute, 1000 steps -> a line per step after the first
    buf2, clock2 = io.StringIO(), _Clock()
    slow = LineProgress(total=1000, desc="x", stream=buf2, every_percent=10, every_seconds=30, clock=clock2)
    for _ in range(3):
        clock2.t += 31
        slow.update(1)
    slow.close()
    assert len(buf2.getvalue().splitlines()) == 3


def test_progress_bar_is_lines_off_a_terminal_and_tqdm_on_one():
    buf = io.StringIO()
    assert isinstance(progress_bar(total=3, stream=buf), LineProgress)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    from tqdm.auto import tqdm

    bar = progress_bar(total=3, stream=Tty())
    assert isinstance(bar, tqdm)
    bar.close()
    assert progress_bar(total=3, disable=True, stream=Tty()).update(1) is None


@pytest.mark.slow
def test_demo_log_written_to_a_file_has_no_redraws_and_no_deepspeed_warning(tmp_path):
    from helpers import DEMO_TINY as TINY  # the demo's tiny budget (tests/helpers.py)

    log = tmp_path / "demo.log"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("DS_ACCELERATOR", None)
    with open(log, "wb") as fh:
        rc = subprocess.run([sys.executable, "-m", "openrlhf_div.cli.main", "demo", "--quick", "--out",
                             str(tmp_path / "demo"), "--methods", "grpo", "--seeds", "0", "--cache-dir",
                             str(tmp_path / "cache"), "--set", *TINY], stdout=fh, stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT, timeout=900).returncode
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "\r" not in text
    assert "warm-up (supervised): " in text and "train grpo: 2/2 (100%)" in text  # progress, as lines
    assert "Setting accelerator to CPU" not in text and "DeepSpeed" not in text
    assert len(text.splitlines()) < 200, len(text.splitlines())


def test_progress_line_has_an_eta_and_the_method_figures():
    """Issue 30: the progress line gains an ETA and the method's key figures (entropy; the anchor
    term for DPH); every evaluation prints one pass@k line."""
    from openrlhf_div.engines.local.trainer import passk_line, progress_figures

    buf, clock = io.StringIO(), _Clock()
    bar = LineProgress(total=100, desc="train dph_js", unit="step", stream=buf, every_percent=25, every_seconds=600,
                       clock=clock)
    m = {"reward_mean": 0.5, "loss": 0.01, "entropy": 0.83, "loss_pef": 0.2, "degenerate_steps_total": 1.0,
         "time_step": 2.0}
    for _ in range(25):
        clock.t += 2.0
        bar.set_postfix(progress_figures(m, 25))
        bar.update(1)
    line = buf.getvalue().splitlines()[0]
    # 25 steps in 50 s: 75 left at 0.5 step/s -> 150 s
    assert "25/100 (25%) 50.0 s, 0.5 step/s, ETA 2 min 30 s," in line, line
    assert "entropy=0.830" in line and "anchor=0.2000" in line and "degenerate=1/25" in line
    assert "anchor=" not in ", ".join(f"{k}={v}" for k, v in progress_figures(
        {k: v for k, v in m.items() if k != "loss_pef"}, 3).items())  # no anchor term: not shown
    row = {"step": 20, "n_prompts": 8, "n_samples": 4, "reward_mean": 0.3, "pass@1": 0.28125, "pass@4": 0.5,
           "pass_at_k": {"1": 0.28125}}
    assert passk_line(row) == "[eval] step 20: pass@1 0.281, pass@4 0.500 (8 prompts x 4 samples)"


#: a metrics.jsonl row of the Ray path (tiny_cpu_dph_js, step 1; OpenRLHF's names + the div actor's)
RAY_ROW = {"step": 1, "div/anchor_frac": 0.25, "policy_loss": -0.0037, "div/loss": 0.0121, "div/loss_exp": 0.0101,
           "div/loss_pef": 0.2, "div/policy_loss": 3.6e-09, "div/entropy": 0.83, "rollout/reward_mean": 0.5,
           "timing/step_total": 2.0, "actor_grad_norm": 0.9, "time": 1795754136.1}


def test_the_ray_progress_line_is_the_local_engines():
    """Issue 30: the Ray controller prints the local engine's line (one formatter,
    :func:`openrlhf_div.progress.step_figures`) from a step's logs: step k/N, ETA, reward, loss,
    entropy, and the anchor term only for a method that has one."""
    from openrlhf_div.engines.local.trainer import progress_figures
    from openrlhf_div.progress import ray_step_figures

    local = {"reward_mean": 0.5, "loss": 0.0121, "entropy": 0.83, "loss_pef": 0.2, "time_step": 2.0}
    assert ray_step_figures(RAY_ROW, 1, anchor=True) == progress_figures(local, 1)
    no_anchor = ray_step_figures(RAY_ROW, 1, anchor=False)  # grpo logs div/loss_pef = 0 too
    assert "anchor" not in no_anchor and no_anchor["entropy"] == "0.830" and no_anchor["reward"] == "0.500"
    # as the controller drives it: a LineProgress of one line per step, started at the resumed step
    buf, clock = io.StringIO(), _Clock()
    bar = LineProgress(total=10, desc="[openrlhf-div] train dph_js", unit="step", initial=2, stream=buf,
                       every_percent=0.0, every_seconds=0.0, clock=clock)
    for step in (3, 4):
        clock.t += 4.0
        bar.set_postfix(ray_step_figures(dict(RAY_ROW, step=step), step, anchor=True))
        bar.update(step - bar.n)
    bar.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2, lines
    # 2 steps in 8 s since the resume: 6 left at 0.25 step/s -> 24 s
    assert lines[1] == ("[openrlhf-div] train dph_js: 4/10 (40%) 8.0 s, 0.25 step/s, ETA 24 s, reward=0.500, "
                        "loss=0.0121, entropy=0.830, anchor=0.2000, s_per_step=2.00"), lines[1]
    # without the actor's entropy (another actor backend) the figure is left out, not invented
    assert "entropy" not in ray_step_figures({k: v for k, v in RAY_ROW.items() if k != "div/entropy"}, 1, True)
