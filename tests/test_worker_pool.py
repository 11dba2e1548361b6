"""The hard-time-limit worker pool behind the math and SQL verifiers."""
import threading

import pytest

from openrlhf_div.tasks._pool import JobResult, WorkerPool, WorkerStartError


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, name="test-pool") as p:
        yield p


def test_results_in_order_with_errors_reported(pool):
    res = pool.run("math:sqrt", [(4,), (9,), ("x",), (16,)], timeout=5)
    assert [r.value for r in res[:2]] + [res[3].value] == [2.0, 3.0, 4.0]
    assert not res[2].ok and res[2].error.startswith("TypeError")


def test_soft_timeout_in_python_code(pool):
    kills = pool.kills
    res = pool.run("time:sleep", [(30,), (0.01,)], timeout=0.3, grace=5)
    assert res[0] == JobResult(False, None, "timeout") and res[1].ok
    assert pool.kills == kills  # the in-worker alarm stopped it: no kill needed


def test_hard_kill_when_signals_cannot_help():
    """A job that ignores SIGALRM (as a long C call does) is killed at timeout + grace."""
    with WorkerPool(1, name="one-worker") as pool:
        res = pool.run("signal:pthread_sigmask", [(0, [14])], timeout=5)  # block SIGALRM in the worker
        assert res[0].ok and pool.starts == 1
        res = pool.run("time:sleep", [(30,)], timeout=0.2, grace=0.3)
        assert res[0].error == "timeout"
        assert pool.kills == 1
        assert pool.run("math:sqrt", [(25,)], timeout=5)[0].value == 5.0  # a fresh worker took over
        assert pool.starts == 2


def test_crash_is_reported_and_worker_replaced(pool):
    res = pool.run("os:_exit", [(7,), (7,)], timeout=5)
    assert [r.error for r in res] == ["crash", "crash"]
    assert pool.run("math:factorial", [(5,)], timeout=5)[0].value == 120


def test_thread_safe(pool):
    out = {}

    def work(i):
        out[i] = [r.value for r in pool.run("math:factorial", [(j,) for j in range(i, i + 5)], timeout=10)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    import math

    assert out == {i: [math.factorial(j) for j in range(i, i + 5)] for i in range(6)}


def test_initializer_failure_is_an_error():
    with WorkerPool(1, initializer="math:sqrt", init_args=("bad",), name="bad-init") as p:
        with pytest.raises(WorkerStartError, match="initializer failed"):
            p.run("math:sqrt", [(4,)], timeout=5)


def test_closed_pool_refuses_work():
    p = WorkerPool(1, name="closed")
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.run("math:sqrt", [(4,)], timeout=1)
    with pytest.raises(ValueError, match="num_workers"):
        WorkerPool(0)
