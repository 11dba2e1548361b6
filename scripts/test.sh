#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole CPU test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k lad -x`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# the real-model tests may not skip here: setup_env.sh installed their GGUF file
export OPENRLHF_DIV_REQUIRE_REAL_MODEL=1
# text files are UTF-8 whatever the locale (a non-UTF-8 LANG would change open()'s default encoding
# in the tests and in every process they start)
export PYTHONUTF8=1
# a native crash in any process the suite starts (a vLLM engine's kernel: SIGILL, SIGSEGV) prints
# its Python frame ("Fatal Python error: ...") into the test output
export PYTHONFAULTHANDLER=1
# one line about this machine (CPU model and flag families, cores, Python, torch, vLLM), so that a
# failure report carries it (scripts/machine_info.py: standard library only)
"$ROOT/.venv/bin/python" "$ROOT/scripts/machine_info.py" || true
# Inductor's compiled kernels (vLLM's CPU sampler, the AOT cache) in a cache of this run's own: a stale
# shared /tmp/torchinductor_root from an earlier run (one that stood in for another CPU) made vLLM's
# sampler abort in test_vllm_weights.py, and a hung worker stalls pytest-xdist
if [ -z "${TORCHINDUCTOR_CACHE_DIR:-}" ]; then
  TORCHINDUCTOR_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/openrlhf-div-inductor.XXXXXX")"
  export TORCHINDUCTOR_CACHE_DIR
fi
# two workers, a test file at a time each (tests/conftest.py); `-n 0` runs in one process.
# The two-node tests (marker two_nodes, root only, ~10 min) are CI's second command (.ci/run);
# `bash scripts/test.sh -m two_nodes -n 0` runs them (a later -m replaces this one).
# (pyproject.toml's addopts leave out the markers ray_faults and two_nodes; a -m given here replaces that)
# --durations: the slowest tests, named in every log (where the suite's time goes)
exec "$ROOT/.venv/bin/python" -m pytest -n 2 --dist loadfile --durations=20 "$@"
