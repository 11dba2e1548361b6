"""scripts/bench_losses.py: the table covers every registered method and rewriting
docs/benchmarks.md replaces only its own section (timings themselves are not asserted)."""
import importlib.util
from pathlib import Path

from openrlhf_div.algorithms import list_methods

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_losses.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_losses", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_table_and_section_rewrite(tmp_path, capsys):
    bench = load()
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Engine\n\nkeep me\n")
    args = ["--batch", "16", "--seq", "8", "--repeats", "1", "--warmup", "0", "--threads", "0",
            "--entropy-vocab", "4", "--malloc", "default", "--output", str(out)]
    bench.main(args)
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\n## Engine\n\nkeep me\n")
    for name in list_methods():
        assert f"| {name} |" in text, name
    for name in ("dph_f", "dph_js", "dph_alpha", "dph_js_def"):  # online + anchor column filled
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        assert row.split("|")[5].strip(), row
    assert "Goal: every method within 1.3x of GRPO" in text
    # hand-written notes after the END marker survive a re-run; the section is not duplicated
    out.write_text(text + "\n### Notes\n\nwhy some miss\n")
    bench.main(args)
    text2 = out.read_text()
    assert text2.count("## Policy losses") == 1 and text2.count(bench.BEGIN) == 1
    assert "keep me" in text2 and text2.rstrip().endswith("why some miss")
