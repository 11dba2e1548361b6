"""benchmarks/bench_logprobs.py: both paths run (in-process and in a fresh interpreter), the table puts
them side by side, and rewriting docs/benchmarks.md replaces only its own section (figures are
not asserted)."""
import argparse
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_logprobs.py"


def test_bench_cases_table_and_section_rewrite(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_logprobs", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = {}
    for path, mode, n in [("old", "train", 8), ("old", "train", 16), ("new", "train", 16), ("new", "train", 32),
                          ("old", "nograd", 16), ("new", "nograd", 16)]:
        peak, sec = bench._case(path, mode, n, 512, 16, 0.7, 1, 4)
        assert peak >= 0 and sec > 0
        res[(path, mode, n)] = dict(peak=max(peak, 1), time=sec, times=[sec])
    args = argparse.Namespace(vocab=512, hidden=16, temperature=0.7, threads=1, chunk=4, repeats=1, case_timeout=600)
    peak, sec = bench.run_case("new", "nograd", 8, args)  # the fresh-interpreter path
    assert peak > 0 and sec > 0
    md = bench.render(res, args, "python benchmarks/bench_logprobs.py --test", 1.0)
    assert "| training (fwd + bwd, entropy) | 32 | ~" in md and "(extrapolated, not run)" in md
    assert "| no-grad (log-probs) | 16 |" in md
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Other\n\nkeep me\n")
    bench.write_section(out, md)
    out.write_text(out.read_text() + "\n### Notes\n\nwhy\n")
    bench.write_section(out, md)
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\n## Other\n\nkeep me\n")
    assert text.count(bench.HEADING) == 1 and text.count(bench.BEGIN) == 1 and text.rstrip().endswith("why")
