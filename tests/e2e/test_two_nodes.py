"""The Ray path across two real nodes (tests/e2e/two_nodes.py): node A runs the Ray head, node B a
worker node; each has its own network namespace (10.200.0.1 / 10.200.0.2 over one veth link), its
own /tmp, /dev/shm and hostname, and its node name resolves to loopback in its own /etc/hosts (the
Debian/Ubuntu default `127.0.1.1 <hostname>`, the classic multi-node trap for gloo). Shared
between them, as on a cluster with a shared filesystem: the repository, its venv and the test's
shared folder (model, data, pre-sampling output, checkpoints). Jobs go through the launcher
(examples/scripts/run.sh ... --submit: real `ray job submit`) from node A.

Root only; skipped with the reason where namespaces cannot be made.
"""
from __future__ import annotations

import os

import pytest

import two_nodes as tn

pytestmark = [pytest.mark.two_nodes, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = tn.unavailable()
    if why:
        pytest.skip(why)
    logs = str(tmp_path_factory.mktemp("two_nodes_logs"))
    c = tn.TwoNodes(gpus={"A": 1, "B": 1}, keep_logs=logs)
    c.start()
    try:
        yield c
    finally:
        c.stop()
        left = c.leftovers()
        assert not left, f"left behind by the two-node harness: {left}"


def test_two_nodes_are_separate_machines(cluster):
    """Two alive Ray nodes with their own addresses and hostnames; a file in B's /tmp is not on A;
    the shared folder is seen by both."""
    assert sorted(cluster.nodes) == [["10.200.0.1", "nodeA"], ["10.200.0.2", "nodeB"]]
    r = cluster.run("B", ["bash", "-c", "hostname; echo b > /tmp/only_on_b; echo s > " + cluster.shared + "/from_b"])
    assert r.returncode == 0 and r.output.split()[0] == "nodeB", r.output
    r = cluster.run("A", ["bash", "-c", "hostname; test -e /tmp/only_on_b && echo SEEN; cat " + cluster.shared + "/from_b"])
    assert r.output.split() == ["nodeA", "s"], r.output
    assert os.path.exists(os.path.join(cluster.node_tmp("B"), "only_on_b"))
    # the node's own name is loopback there (Debian's 127.0.1.1 line): gloo's trap is armed
    r = cluster.run("B", ["getent", "hosts", "nodeB"])
    assert r.output.split()[0].startswith("127."), r.output
