"""benchmarks/bench_loss_share.py: it runs end to end at toy sizes and rewriting docs/benchmarks.md
replaces only its own section (timings themselves are not asserted)."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_loss_share.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_loss_share", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_runs_and_rewrites_only_its_section(tmp_path):
    bench = load()
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Engine\n\nkeep me\n")
    args = ["--hidden", "32", "--layers", "1", "--vocab", "50", "--batch", "4", "--prompt", "3", "--seq", "5",
            "--repeats", "1", "--shapes", "8x4", "--methods", "grpo", "dph_js_def", "--no-compile",
            "--output", str(out)]
    bench.main(args)
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\n## Engine\n\nkeep me\n")
    assert "% of the step" in text and "| grpo | `[8, 4]` |" in text and "| dph_js_def | `[8, 4]` |" in text
    out.write_text(text + "\n### Notes\n\nby hand\n")
    bench.main(args)
    text2 = out.read_text()
    assert text2.count(bench.BEGIN) == 1 and text2.count(bench.SECTION) == 1
    assert "keep me" in text2 and text2.rstrip().endswith("by hand")
