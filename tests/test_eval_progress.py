"""Issue 43 item 4: ``eval`` says how it is doing on every engine -- samples done, tokens/s, ETA,
and while one generate call is slow a line every ``heartbeat_s`` (a CPU evaluation of long
responses printed nothing for 12 minutes) -- and ``--max-new-tokens`` defaults to the task's."""
from __future__ import annotations

import re
import time

from openrlhf_div.eval.evaluate import evaluate
from openrlhf_div.tasks import get_task


def _slow_generate(delay: float):
    def gen(prompts, n, temperature, top_p, max_new_tokens, greedy):
        time.sleep(delay)
        return [["The answer is 4"] * n for _ in prompts]
    return gen


def test_progress_lines_name_samples_tokens_per_second_and_eta(capsys):
    task = get_task("math")
    examples = [{"prompt": f"{i} + 2?", "label": "4", "source": "t", "id": str(i)} for i in range(4)]
    evaluate(task, examples, _slow_generate(0.6), n=2, ks=[1, 2], batch_size=2, max_new_tokens=64,
             heartbeat_s=0.2)
    err = capsys.readouterr().err
    beats = [ln for ln in err.splitlines() if "generating samples" in ln]
    # the first call: nothing finished yet; the second: a rate and an ETA
    assert any("0/8 samples done; generating samples 1-4 (2 prompt(s) x 2, up to 64 new tokens each)" in ln
               and "no sample finished yet" in ln for ln in beats), err
    assert any(ln.startswith("eval math: 4/8 samples done; generating samples 5-8") and "tokens/s so far, ETA" in ln
               for ln in beats), err
    final = [ln for ln in err.splitlines() if ln.startswith("eval math: 8/8 (100%)")]
    assert final and re.search(r"sample/s, [\d.]+ tokens/s", final[-1]), err


def test_no_heartbeat_without_progress(capsys):
    task = get_task("math")
    examples = [{"prompt": "1 + 3?", "label": "4", "source": "t", "id": "0"}]
    evaluate(task, examples, _slow_generate(0.4), n=1, ks=[1], max_new_tokens=8, heartbeat_s=0.1, progress=False)
    assert "generating samples" not in capsys.readouterr().err


def test_the_default_response_length_is_the_task_s():
    from openrlhf_div.cli.main import build_parser

    args = build_parser().parse_args(["eval", "--model", "m", "--task", "demo", "--data", "d.jsonl"])
    assert args.max_new_tokens is None  # resolved from the task once it is built
    assert get_task("demo").eval_max_new_tokens == 16 and get_task("math").eval_max_new_tokens == 1024
    help_text = build_parser()._subparsers._group_actions[0].choices["eval"].format_help()
    assert "default: the task's" in " ".join(help_text.split())
