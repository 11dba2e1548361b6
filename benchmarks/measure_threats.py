"""Re-measure the threat table of docs/tasks.md (issue 14's fault campaign, after the fixes).

    python benchmarks/measure_threats.py [--out FILE.md] [--skip-training]

Each row runs the attack for real (hostile SQL on the fixture databases in sandbox workers,
hostile responses through the verifiers, a plain script in a subprocess, tiny training runs
with poisoned learning rates and damaged files) and reports what happened, with wall-clock
figures from this machine. Prints a Markdown table (and writes it to ``--out``). A few minutes
on 2 CPU cores; nothing is left running.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ROWS = []


def row(threat, tried, result):
    ROWS.append((threat, tried, result))
    print(f"- {threat}: {result}", flush=True)


def timed(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return out, time.perf_counter() - t0


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ------------------------------------------------------------------ SQL
HOSTILE_SQL = [
    "DELETE FROM schools", "UPDATE schools SET name = 'x'", "INSERT INTO schools(cds_code, name) VALUES ('9', 'x')",
    "DROP TABLE schools", "CREATE TABLE evil(a)", "CREATE TEMP TABLE evil AS SELECT 1", "ALTER TABLE schools ADD COLUMN e",
    "CREATE TRIGGER t AFTER INSERT ON schools BEGIN DELETE FROM schools; END", "CREATE VIEW v AS SELECT 1",
    "CREATE INDEX i ON schools(name)", "CREATE VIRTUAL TABLE v USING json_each", "ATTACH DATABASE '{tmp}/e.sqlite' AS e",
    "DETACH DATABASE main", "VACUUM", "VACUUM INTO '{tmp}/copy.sqlite'", "PRAGMA writable_schema = ON",
    "PRAGMA journal_mode = WAL", "PRAGMA user_version = 7", "PRAGMA query_only = 0", "SELECT load_extension('{tmp}/e.so')",
    "BEGIN IMMEDIATE", "SAVEPOINT s1", "RELEASE s1", "ROLLBACK", "COMMIT", "REINDEX", "ANALYZE",
    "SELECT 1; DROP TABLE schools", "SELECT 1; /* x */ DELETE FROM schools", "UPDATE sqlite_master SET sql = ''",
    "DELETE FROM sqlite_master", "INSERT INTO sqlite_master VALUES ('table','x','x',0,'')",
    "SELECT * FROM pragma_table_info('schools')", "SELECT writefile('{tmp}/x', 'y')", "SELECT readfile('/etc/passwd')",
    "SELECT fts3_tokenizer('simple')", "REPLACE INTO schools(cds_code) VALUES ('1')",
    "WITH x AS (SELECT 1) DELETE FROM schools", "ＤＥＬＥＴＥ FROM schools", "DELETE\u200bFROM schools",
]


def measure_sql(db_root, tmp):
    from openrlhf_div.tasks import get_task
    from openrlhf_div.tasks.sqlite_sandbox import SQLExecutor, limit_address_space, run_query

    task = get_task("sql", db_root=db_root, timeout=5.0, num_workers=2)
    gold = {"db_id": "school", "sql": "SELECT count(*) FROM schools"}
    db = os.path.join(db_root, "school", "school.sqlite")
    before, files = sha(db), sorted(os.listdir(os.path.dirname(db)))
    fenced = lambda q: f"```sql\n{q.replace('{tmp}', tmp)}\n```"  # noqa: E731
    task.reward_results([fenced("SELECT 1")], [gold])  # start the workers
    worst = 0.0
    refused = 0
    for q in HOSTILE_SQL:
        r, dt = timed(task.reward_result, fenced(q), gold)
        worst = max(worst, dt)
        refused += r.reward == 0.0
    same = sha(db) == before and sorted(os.listdir(os.path.dirname(db))) == files and not os.listdir(tmp)
    row("SQL writes / DDL / ATTACH / PRAGMA / extensions / hidden statements",
        f"{len(HOSTILE_SQL)} hostile statements (writes, CREATE TEMP/TRIGGER/VIEW/VIRTUAL, ATTACH/DETACH, VACUUM INTO, "
        "PRAGMA writes, load_extension, readfile/writefile, sqlite_master writes, hidden second statements, "
        "full-width and zero-width unicode)",
        f"{refused}/{len(HOSTILE_SQL)} scored 0, each answered in <= {worst * 1000:.0f} ms; database and folder "
        f"{'unchanged' if same else 'CHANGED'}")

    bombs = ["WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
             "SELECT count(*) FROM numbers a, numbers b, numbers c, numbers d"]
    res = []
    for q in bombs:
        r, dt = timed(task.reward_result, fenced(q), gold)
        res.append((r.reason, dt))
    row("SQL CPU bombs", "infinite recursive CTE; 4-way cross join (time limit 5 s)",
        "; ".join(f"`{why}` after {dt:.2f} s" for why, dt in res))

    big = ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n+1 FROM r WHERE n<10000) "
           "SELECT zeroblob(9000000) FROM r")
    kills = task.executor.pool.kills
    r, dt = timed(task.reward_result, fenced(big), gold)
    # the worker's peak memory, measured in a child that runs the same query under the same limits
    code = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {ROOT!r})
        from openrlhf_div.tasks.sqlite_sandbox import limit_address_space, run_query
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        limit_address_space(2048)
        out = run_query({db!r}, {big!r}, 5.0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(out.get("error"), (peak - base) / 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    err, grow = out.stdout.rsplit(None, 1) if out.stdout.strip() else ("?", "nan")
    row("SQL memory bomb (rows fetched into Python)",
        "`SELECT zeroblob(9000000)` x 10,000 rows (9 GB), default limits",
        f"reward {r.reward:.0f}, `{r.reason}` after {dt:.2f} s; worker replaced "
        f"({task.executor.pool.kills - kills} kill); peak growth of a worker running it: {float(grow):.0f} MB "
        f"(was 9.1 GB)")

    os.environ["OPENRLHF_DIV_MP_CONTEXT"] = "fork"
    import openrlhf_div.tasks.sqlite_sandbox as sb

    real = sb.execute_and_compare
    sb.execute_and_compare = _c_hang
    ex = SQLExecutor(timeout=5.0, num_workers=3)
    try:
        res, dt = timed(ex.compare_many, [(db, "SELECT 1", "SELECT 1")])
    finally:
        ex.pool.close()
        sb.execute_and_compare = real
        os.environ.pop("OPENRLHF_DIV_MP_CONTEXT")
    row("SQL hang inside C code", "a job blocking SIGALRM and spinning in C (catastrophic regex), time limit 5 s",
        f"`{res[0]['reason']}`, worker killed after {dt:.2f} s (was held 11 s: 2 x limit + 1)")

    r, dt = timed(task.reward_result, fenced("SELECT count(*) FROM schools, json_each('[1,2]')"),
                  {"db_id": "school", "sql": "SELECT 2 * count(*) FROM schools"})
    row("harmless `json_each` refused", "`SELECT count(*) FROM schools, json_each('[1,2]')` vs its gold",
        f"reward {r.reward:.0f} (`{r.reason}`) in {dt * 1000:.0f} ms (the sqlite_master writes of the first row stay refused)")

    # many concurrent queries while workers are being killed
    qs = ["SELECT count(*) FROM schools", bombs[0], "SELECT name FROM schools LIMIT 3", "DELETE FROM schools"]
    got, killed = [], [0]
    stop = threading.Event()

    def killer():
        while not stop.is_set():
            time.sleep(0.4)
            for w in list(task.executor.pool._all):
                if w.proc is not None and w.proc.is_alive():
                    try:
                        os.kill(w.proc.pid, signal.SIGKILL)
                        killed[0] += 1
                    except OSError:
                        pass
                    break

    def client(i):
        got.extend(task.reward_results([fenced(qs[(i + j) % len(qs)]) for j in range(10)], [gold] * 10))

    kt = threading.Thread(target=killer)
    kt.start()
    t0 = time.perf_counter()
    cs = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for c in cs:
        c.start()
    for c in cs:
        c.join()
    stop.set()
    kt.join()
    row("SQL under concurrency and worker kills", f"8 threads x 10 mixed queries, a worker SIGKILLed every 0.4 s",
        f"{len(got)}/80 results returned in {time.perf_counter() - t0:.1f} s with {killed[0]} kills; "
        f"{task.executor.pool.retries} crashed items retried once")


def _c_hang(*args):  # runs in a forked worker
    import re

    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    re.match(r"(a+)+$", "a" * 40 + "b")
    return {"correct": True, "reason": "ok"}


# ------------------------------------------------------------------ parsing
def measure_parsing():
    from openrlhf_div.tasks import get_task

    math, cd = get_task("math", timeout=5.0), get_task("countdown")
    cases = [
        ("sql", "80 KB SQL response of `/* x`", "```sql\nSELECT 1 " + "/* x" * 20000, None),
        ("math", "28 KB of `\\boxed{`", "\\boxed{" * 4000, "1"),
        ("math", "`The answer is a` + 64 KB of spaces + `b`", "The answer is a" + " " * 65536 + "b", "1"),
        ("countdown", "128 KB countdown answer (`<answer>` x 16,384)", "<answer>" * 16384,
         {"target": 3, "numbers": [1, 2]}),
        ("math", "10 MB of junk then `\\boxed{7}`", "x " * 5_000_000 + "\\boxed{7}", "7"),
    ]
    from openrlhf_div.tasks.sql import extract_sql

    for kind, what, text, label in cases:
        if kind == "sql":
            _, dt = timed(extract_sql, text)
        else:
            _, dt = timed((math if kind == "math" else cd).reward_result, text, label)
        row("answer parsing stalls the trainer", what, f"scored in {dt:.3f} s (limit 0.5 s)")

    r, dt = timed(math.reward_result, "\\boxed{2^{2^{2^{2^{2}}}}}", "2^{65536}")
    row("power tower graded wrong", "`2^{2^{2^{2^{2}}}}` vs `2^{65536}`", f"reward {r.reward:.0f} in {dt * 1000:.1f} ms")
    r, dt = timed(math.reward_result, "\\boxed{10^{10^{10^{10}}}}", "5")
    row("math CPU bomb", "`\\boxed{10^{10^{10^{10}}}}` (sympy builds the integer in C)",
        f"`{r.reason}` after {dt:.2f} s (time limit 5 s)")
    inj = ["__import__('os').system('touch /tmp/pwned')", "2**10**10", "(lambda: 1)()", "1 if 1 else 2",
           "open('/etc/passwd').read()", "9" * 400, "(" * 200 + "1" + ")" * 200, "1/0", "1;2", "1e9"]
    res = [cd.reward_result(f"<answer>{s}</answer>", {"target": 3, "numbers": [1, 2]}) for s in inj]
    row("countdown code injection", f"{len(inj)} strings (`__import__`, `**`, lambdas, 400 digits, 200-deep parens)",
        f"{sum(r.reward < 1 for r in res)}/{len(inj)} rejected by the parser, no code run "
        f"({'no' if not os.path.exists('/tmp/pwned') else 'A'} /tmp/pwned)")
    r = get_task("math").reward_result("32 - 30 = 2. I made a mistake.", "2")
    row("lenient grading (issue 16)", "`32 - 30 = 2. I made a mistake.` vs `2`",
        f"reward {r.reward:.0f} (`{r.reason}`): strict by default, `extract=lenient` for the last number")


# ------------------------------------------------------------------ pools
def measure_pools(tmp):
    from openrlhf_div.tasks._pool import WorkerPool

    script = os.path.join(tmp, "plain.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent("""
            from openrlhf_div.tasks import get_task
            print("TOPLEVEL", flush=True)
            res = get_task("math").reward_results(["\\\\boxed{\\\\sqrt{4}}"], ["2"])
            print("RESULT", res[0].reward, flush=True)
        """))
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    row("worker pools re-run the user's script", "a plain script without `if __name__ == '__main__'` calling "
        "`get_task('math').reward_results`", f"top level ran {out.stdout.count('TOPLEVEL')} time(s); "
        f"reward {out.stdout.split('RESULT')[-1].strip() if 'RESULT' in out.stdout else '?'}")
    marker = os.path.join(tmp, "m")
    with WorkerPool(1, name="retry", context="fork") as pool:
        res = pool.run("benchmarks.measure_threats:_crash_first", [(marker,)], timeout=5)
    row("a crashed worker's item scores 0", "a job whose worker dies on the first attempt",
        f"{'ok' if res[0].ok else res[0].error} after {pool.retries} retry")


def _crash_first(marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return "ok"


# ------------------------------------------------------------------ training
def measure_training(tmp):
    import torch

    from openrlhf_div.engines.local.checkpoint import CorruptCheckpointError, NonFiniteWeightsError
    from openrlhf_div.engines.local.config import load_config
    from openrlhf_div.io import atomic_write_jsonl
    from openrlhf_div.engines.local.presample import presample
    from openrlhf_div.engines.local.toy import VOCAB, make_examples
    from openrlhf_div.engines.local.trainer import train

    torch.set_num_threads(1)
    data = os.path.join(tmp, "train.jsonl")
    atomic_write_jsonl(data, make_examples(24, seed=1))

    def ov(out, *extra):
        return ["task=toy_copy", f"output_dir={out}", f"model.tiny_vocab={VOCAB}", f"data.train={data}",
                "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=3", "optim.steps=2",
                "optim.learning_rate=1e-2", "eval.at_start=false", "logging.tensorboard=false",
                "logging.progress=false", "checkpoint.every=1", "method.name=grpo", *extra]

    for lr in ("inf", "1e6"):
        out = os.path.join(tmp, f"lr{lr}")
        try:
            train(overrides=ov(out, f"optim.learning_rate={lr}", "optim.steps=4"))
            msg = "exited normally"
        except NonFiniteWeightsError as e:
            msg = str(e).split("; nothing")[0]
        ck = os.path.join(out, "checkpoints")
        saved = sorted(d for d in os.listdir(ck) if d.startswith("step_")) if os.path.isdir(ck) else []
        row("poisoned weights checkpointed", f"`optim.learning_rate={lr}`",
            f"stopped: {msg}; checkpoints written: {', '.join(saved) or 'none'}")

    out = os.path.join(tmp, "torn")
    train(overrides=ov(out))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "reward_mean": 0.')
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = train(resume=out, overrides=["optim.steps=3"])
    row("torn last line of metrics.jsonl", "a cut-off last line, then `--resume`",
        f"resumed to step {res['metrics']['step']}; warned: {sum('torn last line' in str(x.message) for x in w)}")

    st = os.path.join(out, "checkpoints", "step_000003", "trainer_state.pt")
    with open(st, "r+b") as f:
        f.truncate(100)
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        res = train(resume=out, overrides=["optim.steps=4"])
    said = buf.getvalue()
    row("truncated file in the latest checkpoint", "`trainer_state.pt` of the latest checkpoint cut to 100 bytes, "
        "then `--resume`", f"named ({'trainer_state.pt: 100 bytes' in said}), fell back to step_000002 "
        f"({'step_000002' in said}) and reached step {res['metrics']['step']}")
    w_file = next(os.path.join(dp, n) for dp, _, ns in os.walk(os.path.join(out, "checkpoints", "step_000004"))
                  for n in ns if n.endswith(".safetensors"))
    for d in os.listdir(os.path.join(out, "checkpoints")):
        if d.startswith("step_") and d != "step_000004":
            shutil.rmtree(os.path.join(out, "checkpoints", d))
    with open(w_file, "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    try:
        train(resume=out, overrides=["optim.steps=5"])
        msg = "loaded"
    except CorruptCheckpointError as e:
        msg = str(e).splitlines()[1].strip().replace(out, "RUN")
    row("altered weights, no intact checkpoint", "one flipped byte in `model.safetensors`, the only checkpoint",
        f"error: `{msg}`")

    cfg = load_config(None, ov(os.path.join(tmp, "ps_run"), "presample.n_pre=2", "presample.chunk_size=8"))
    ps = os.path.join(tmp, "ps")
    presample(cfg, ps, progress=False, max_new_chunks=2)
    chunk = os.path.join(ps, "shards", "chunk_000001.json")
    with open(chunk, "r+b") as f:
        f.truncate(os.path.getsize(chunk) // 2)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        s = presample(cfg, ps, progress=False)
    row("truncated pre-sampling chunk", "`chunk_000001.json` cut in half, then presample again",
        f"named ({'chunk_000001.json' in buf.getvalue()}), recomputed, complete={s['complete']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the Markdown table here")
    ap.add_argument("--skip-training", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="threats-")
    try:
        db_root = os.path.join(tmp, "dbs")
        # the fixture databases, built by their generator (run as a tool: nothing is imported from tests/)
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tools", "make_fixture_db.py"), "--out", db_root],
                       check=True, stdout=subprocess.DEVNULL)
        side = os.path.join(tmp, "side")
        os.makedirs(side)
        measure_sql(db_root, side)
        measure_parsing()
        measure_pools(tmp)
        if not args.skip_training:
            measure_training(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = ["| threat | what was tried | result (measured) |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in ROWS]
    table = "\n".join(lines) + "\n"
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
