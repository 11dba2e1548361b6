#!/usr/bin/env python
"""Throughput of the verifiers (samples per second per core): math, SQL, Countdown.

    python benchmarks/bench_verifiers.py                # writes docs/benchmarks_verifiers.md
    python benchmarks/bench_verifiers.py --quick --out /tmp/bench.md

Per core: the math and SQL verifiers run with ONE worker process, and the rate is reported two
ways -- per wall-clock second, and per CPU second (the parent's plus the worker's user+system
time, read from /proc), the latter being robust on a shared, loaded machine. Each number is the
best of ``--repeats`` runs.

Workloads:

* math -- synthetic chain-of-thought responses (~0.8 kB) ending in ``\\boxed{...}``, answers
  drawn like MATH500/AIME: 60% integers, 15% fractions, 10% radicals / pi expressions, 5%
  intervals, sets and tuples, 10% wrong answers; plus the two extremes separately (integers
  only: the exact fast path; symbolic only: every check goes through math-verify).
* sql -- BIRD-style (pred, gold) pairs on the fixture database (point lookups, joins,
  aggregates; one gold per 4 samples as in training), compared against running the same two
  queries with plain ``sqlite3`` in-process: the difference is the sandbox's overhead.
* countdown -- responses with a think block and an ``<answer>`` equation, 3-4 numbers,
  80% correct.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import sqlite3
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from openrlhf_div.tasks import get_task  # noqa: E402


def cpu_seconds(pids):
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def worker_pids(pool):
    return [w.proc.pid for w in pool._all if w.proc is not None and w.proc.is_alive()]


def measure(make_fn, pids_fn, n_items, repeats):
    """``make_fn(rep)`` returns the thunk to time (fresh inputs per repeat, so no cache makes
    a repeat look faster than a training step would be)."""
    best_wall, best_cpu = 0.0, 0.0
    for rep in range(repeats):
        fn = make_fn(rep)
        pids = [os.getpid()] + pids_fn()
        c0, t0 = cpu_seconds(pids), time.perf_counter()
        fn()
        t1, c1 = time.perf_counter(), cpu_seconds(pids)
        best_wall = max(best_wall, n_items / (t1 - t0))
        if c1 > c0:
            best_cpu = max(best_cpu, n_items / (c1 - c0))
    return best_wall, best_cpu


# --------------------------------------------------------------------------- math
FILLER = ("Let us set up the problem carefully. We denote the unknown quantity by $x$ and translate the "
          "conditions into equations. Substituting the first relation into the second gives a linear "
          "equation, which we simplify step by step: $3x + 5 = 2(x + 4)$, so $x = 3$. Checking the "
          "boundary cases confirms that no other value works, and the constraints are satisfied. ")


def math_cases(n, rng, kind="mix"):
    out = []
    for _ in range(n):
        r = rng.random() if kind == "mix" else {"int": 0.0, "symbolic": 0.7}[kind]
        if kind == "symbolic":
            r = 0.6 + 0.3 * rng.random()
        if r < 0.60:
            v = rng.randint(0, 99999)
            pred, gold = str(v), str(v)
        elif r < 0.75:
            a, b = rng.randint(1, 999), rng.randint(2, 999)
            pred, gold = rf"\frac{{{a}}}{{{b}}}", rf"\dfrac{{{a}}}{{{b}}}" if rng.random() < 0.5 else f"{a}/{b}"
        elif r < 0.85:
            k, m = rng.randint(2, 400), rng.choice([2, 3, 5, 6, 7, 10, 11, 13])
            pred, gold = rng.choice([(rf"{k}\sqrt{{{m}}}", rf"\sqrt{{{m * k * k}}}"),
                                     (rf"\frac{{{k}\pi}}{{{m}}}", rf"{k}\pi/{m}"),
                                     (rf"\frac{{\sqrt{{{m}}}}}{{{k}}}", rf"\frac{{1}}{{{k}}}\sqrt{{{m}}}")])
        elif r < 0.90:
            a, d = rng.randint(-500, 500), rng.randint(1, 500)
            pred, gold = rng.choice([(f"({a}, {a + d}]", f"({a},{a + d}]"),
                                     (rf"\{{{a}, {a + d}\}}", rf"\{{{a + d},{a}\}}"),
                                     (f"({a}, {a * 2})", f"({a},{a * 2})")])
        else:
            v = rng.randint(0, 99999)
            pred, gold = rng.choice([(str(v + 1), str(v)), (rf"\frac{{{v}}}{{7}}", str(v)),
                                     (rf"{v}\sqrt{{2}}", str(v))])
        out.append((FILLER * 2 + rf"Therefore the answer is $\boxed{{{pred}}}$.", gold))
    return out


def bench_math(n, repeats, rng):
    rows = []
    task = get_task("math", timeout=5.0, num_workers=1)
    pool = task.verifier.pool
    task.reward_results([r"\boxed{\sqrt{2}}"], ["2^{1/2}"])  # start + warm the worker
    accs = []

    def runner(t, kind):
        def make(rep):
            cases = math_cases(n, rng, kind)
            resp, gold = [c[0] for c in cases], [c[1] for c in cases]

            def run():
                res = t.reward_results(resp, gold)
                accs.append(sum(r.correct for r in res) / len(res))
            return run
        return make

    for kind, label in (("mix", "typical mix"), ("int", "integers only (fast path)"),
                        ("symbolic", "symbolic only (all via math-verify)")):
        accs.clear()
        wall, cpu = measure(runner(task, kind), lambda: worker_pids(pool), n, repeats)
        rows.append((f"math, {label}", "process pool, 1 worker", wall, cpu, f"accuracy {sum(accs) / len(accs):.2f}"))
    inline = get_task("math", timeout=5.0, timeout_mode="inline")
    inline.reward_results([r"\boxed{\sqrt{2}}"], ["2^{1/2}"])
    accs.clear()
    wall, cpu = measure(runner(inline, "mix"), lambda: [], n, repeats)
    rows.append(("math, typical mix", "inline (SIGALRM, main thread)", wall, cpu,
                 f"accuracy {sum(accs) / len(accs):.2f}; no hard limit on C code"))
    return rows


# --------------------------------------------------------------------------- sql
SQL_PAIRS = [
    ("SELECT COUNT(*) FROM schools WHERE county = 'Fresno' AND charter = 1",
     "SELECT count(cds_code) FROM schools WHERE charter = 1 AND county = 'Fresno'"),
    ("SELECT s.name FROM schools s JOIN sat_scores t ON s.cds_code = t.cds_code ORDER BY t.avg_math DESC LIMIT 1",
     "SELECT name FROM schools WHERE cds_code = (SELECT cds_code FROM sat_scores ORDER BY avg_math DESC LIMIT 1)"),
    ("SELECT AVG(t.num_takers) FROM sat_scores t JOIN schools s ON s.cds_code = t.cds_code WHERE s.county = 'Alameda'",
     "SELECT SUM(t.num_takers) * 1.0 / COUNT(*) FROM sat_scores t JOIN schools s USING (cds_code) "
     "WHERE s.county = 'Alameda'"),
    ("SELECT county, COUNT(*) FROM schools GROUP BY county",
     "SELECT county, COUNT(*) FROM schools GROUP BY county ORDER BY 2 DESC"),
    ("SELECT n FROM numbers WHERE n % 7 = 0", "SELECT n FROM numbers WHERE n % 7 = 0 AND n > 0"),
    ("SELECT a.n, b.n FROM numbers a JOIN numbers b ON a.n * 3 = b.n WHERE a.n < 50",
     "SELECT a.n, a.n * 3 FROM numbers a WHERE a.n < 50 AND a.n * 3 <= 300"),
]


def bench_sql(n, repeats, rng):
    root = tempfile.mkdtemp(prefix="bench-dbs-")
    # the fixture databases, built by their generator (run as a tool: nothing is imported from tests/)
    subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "tests", "tools", "make_fixture_db.py"),
                    "--out", root], check=True, stdout=subprocess.DEVNULL)
    db = os.path.join(root, "school", "school.sqlite")
    task = get_task("sql", db_root=root, timeout=5.0, num_workers=1)
    pool = task.executor.pool
    labels, resps = [], []
    for i in range(n):
        gold, pred = SQL_PAIRS[(i // 4) % len(SQL_PAIRS)]  # 4 samples share a gold query
        labels.append({"db_id": "school", "sql": gold})
        resps.append(f"Reasoning about the schema...\n```sql\n{pred}\n```")
    res = task.reward_results(resps[:8], labels[:8])
    assert all(r.correct for r in res), [r.reason for r in res]
    rows = []
    wall, cpu = measure(lambda rep: (lambda: task.reward_results(resps, labels)), lambda: worker_pids(pool), n,
                        repeats)
    rows.append(("sql, BIRD-style pairs", "sandbox, 1 worker (gold cached)", wall, cpu, "pred + gold per sample"))

    def raw():
        conn = sqlite3.connect(db)
        for i in range(n):
            gold, pred = SQL_PAIRS[(i // 4) % len(SQL_PAIRS)]
            set(conn.execute(pred).fetchall()) == set(conn.execute(gold).fetchall())  # noqa: B015
        conn.close()

    wall_r, cpu_r = measure(lambda rep: raw, lambda: [], n, repeats)
    rows.append(("sql, BIRD-style pairs", "plain sqlite3 in-process, no sandbox", wall_r, cpu_r,
                 "both queries every time"))

    # heavier queries (a 50k-row table, ms per query, like a mid-sized BIRD database): here the
    # sandbox should cost little next to execution. Gold is cached in the sandbox, so the plain
    # baseline runs it once per distinct gold too.
    big = os.path.join(root, "bench", "bench.sqlite")
    os.makedirs(os.path.dirname(big), exist_ok=True)
    conn = sqlite3.connect(big)
    conn.executescript(
        "CREATE TABLE customers(id INTEGER PRIMARY KEY, region TEXT);"
        "CREATE TABLE orders(id INTEGER PRIMARY KEY, customer INTEGER, amount REAL, day INTEGER);"
        "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < 2000) "
        "INSERT INTO customers SELECT i, 'r' || (i % 17) FROM c;"
        "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < 50000) "
        "INSERT INTO orders SELECT i, 1 + abs(random()) % 2000, (abs(random()) % 100000) / 100.0, i % 365 FROM c;")
    conn.commit()
    heavy = [("SELECT c.region, round(SUM(o.amount), 2) FROM orders o JOIN customers c ON c.id = o.customer "
              "GROUP BY c.region", "SELECT region, round(total, 2) FROM (SELECT c.region, SUM(o.amount) AS total "
              "FROM customers c JOIN orders o ON o.customer = c.id GROUP BY c.region)"),
             ("SELECT customer FROM orders GROUP BY customer ORDER BY SUM(amount) DESC LIMIT 5",
              "SELECT customer FROM (SELECT customer, SUM(amount) s FROM orders GROUP BY customer) "
              "ORDER BY s DESC LIMIT 5"),
             ("SELECT day, COUNT(*) FROM orders WHERE amount > 500 GROUP BY day",
              "SELECT day, SUM(amount > 500) FROM orders GROUP BY day HAVING SUM(amount > 500) > 0")]
    m = max(20, n // 10)
    h_labels = [{"db_id": "bench", "sql": heavy[(i // 4) % len(heavy)][0]} for i in range(m)]
    h_resps = [f"```sql\n{heavy[(i // 4) % len(heavy)][1]}\n```" for i in range(m)]
    res = task.reward_results(h_resps[:12], h_labels[:12])
    assert all(r.correct for r in res), [r.reason for r in res]
    wall, cpu = measure(lambda rep: (lambda: task.reward_results(h_resps, h_labels)), lambda: worker_pids(pool), m,
                        repeats)
    rows.append(("sql, heavier queries (50k rows)", "sandbox, 1 worker (gold cached)", wall, cpu,
                 "pred per sample, gold once per query"))

    def raw_heavy():
        c = sqlite3.connect(big)
        gold_cache = {}
        for i in range(m):
            gold, pred = heavy[(i // 4) % len(heavy)]
            if gold not in gold_cache:
                gold_cache[gold] = set(c.execute(gold).fetchall())
            set(c.execute(pred).fetchall()) == gold_cache[gold]  # noqa: B015
        c.close()

    wall_r, cpu_r = measure(lambda rep: raw_heavy, lambda: [], m, repeats)
    rows.append(("sql, heavier queries (50k rows)", "plain sqlite3 in-process, no sandbox", wall_r, cpu_r,
                 "same caching of gold"))
    return rows


# --------------------------------------------------------------------------- countdown
def bench_countdown(n, repeats, rng):
    from openrlhf_div.tasks.countdown import generate_countdown

    inst = generate_countdown(200, seed=1)
    task = get_task("countdown")
    resps, labels = [], []
    for i in range(n):
        x = inst[i % len(inst)]
        eq = x["solution"] if rng.random() < 0.8 else " + ".join(map(str, x["numbers"]))
        resps.append(f"<think>Try combining {x['numbers']} to reach {x['target']}.</think>\n<answer>{eq}</answer>")
        labels.append({"target": x["target"], "numbers": x["numbers"]})
    wall, cpu = measure(lambda rep: (lambda: task.reward_results(resps, labels)), lambda: [], n, repeats)
    return [("countdown", "in-process parser", wall, cpu, "80% correct")]


def write_report(rows, path, args):
    import math_verify  # noqa: F401
    from importlib.metadata import version

    cpu_model = "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg()
    lines = [
        "# Verifier throughput",
        "",
        "Samples per second per core, from `python benchmarks/bench_verifiers.py` "
        f"({'--quick, ' if args.quick else ''}{args.n} samples per workload, best of {args.repeats}).",
        "\"per CPU s\" divides by the user+system CPU time of the caller and its one worker process",
        "(the fair per-core figure on a shared machine); \"per wall s\" is the elapsed-time rate.",
        "",
        f"Machine: {cpu_model}, {os.cpu_count()} cores, load average {load[0]:.1f} during the run "
        f"(shared with other jobs); Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"math-verify {version('math-verify')}.",
        "",
        "| workload | how | samples / CPU s | samples / wall s | note |",
        "|---|---|---:|---:|---|",
    ]
    for name, how, wall, cpu, note in rows:
        lines.append(f"| {name} | {how} | {cpu:,.0f} | {wall:,.0f} | {note} |")
    lines += [
        "",
        "Goals (issue): math >= 200/s/core on typical answers; SQL limited only by query execution; "
        "Countdown >= 10,000/s.",
        "",
        "Reading the table:",
        "",
        "- CPU time comes from /proc in 10 ms ticks, so the fastest rows are coarse (e.g. 50,000 = 1,000 "
        "samples in 0.02 CPU s); Countdown runs 10x the samples for that reason.",
        "- Math: integer answers never leave the caller (exact comparison); the typical mix spends its time in "
        "the ~25% of answers that need math-verify (about 3 ms each, see the symbolic-only row). The process "
        "pool costs little against the inline mode and is the only one with a hard limit that also works "
        "off the main thread. Identical (answer, gold) pairs -- common among the samples of one prompt -- "
        "are checked once, which this benchmark (all answers distinct) does not exploit.",
        "- SQL: with the fixture's microsecond queries the sandbox's fixed cost per sample (a pipe round trip "
        "to the worker, about 0.2 ms) dominates; with queries that take milliseconds the sandbox's rate per "
        "CPU second is close to plain sqlite3's, i.e. execution-bound. Gold results are cached per worker "
        "(the samples of a prompt share one gold query).",
        "- Wall-clock rates on a machine shared with other jobs are noisy (the worker process competes for "
        "the cores); compare the CPU-second column.",
        "",
    ]
    text = "\n".join(lines)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".md")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "benchmarks_verifiers.md"))
    ap.add_argument("--n", type=int, default=2000, help="samples per workload (countdown uses 10x)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="n=300, 2 repeats")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.repeats = 300, 2
    rng = random.Random(args.seed)
    rows = []
    for name, fn, n in (("math", bench_math, args.n), ("sql", bench_sql, args.n),
                        ("countdown", bench_countdown, 10 * args.n)):
        print(f"benchmarking {name} ...", file=sys.stderr, flush=True)
        rows += fn(n, args.repeats, rng)
    text = write_report(rows, args.out, args)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
