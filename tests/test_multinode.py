"""Multi-node helpers of the Ray path (openrlhf_div/engines/openrlhf/nodes.py) without a cluster;
tests/e2e/test_two_nodes.py runs them across two real nodes."""
from __future__ import annotations

import types

import psutil
import pytest

from openrlhf_div.engines.openrlhf import jobs, nodes


def _local_non_loopback():
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return name, a.address
    return None


def test_gloo_interface_is_the_one_carrying_the_node_address():
    found = _local_non_loopback()
    if found is None:
        pytest.skip("no non-loopback IPv4 interface on this machine")
    name, ip = found
    assert nodes.interface_of(ip) == name
    assert nodes.gloo_interface({}, node_ip=ip) == name
    # the user's choice wins; switched off; one machine on loopback; an address nobody holds
    assert nodes.gloo_interface({"GLOO_SOCKET_IFNAME": "ib0"}, node_ip=ip) is None
    assert nodes.gloo_interface({nodes.AUTO_VAR: "0"}, node_ip=ip) is None
    assert nodes.gloo_interface({}, node_ip="127.0.0.1") is None
    assert nodes.gloo_interface({}, node_ip="192.0.2.123") is None


def test_every_run_installs_the_worker_setup_hook():
    assert jobs.job_runtime_env(jobs.__file__.rsplit("/", 1)[0], {})["worker_process_setup_hook"] == nodes.HOOK
    assert jobs.driver_runtime_env({})["worker_process_setup_hook"] == nodes.HOOK
    # inside a submitted job whose runtime env has it already, the driver does not set it twice
    job = '{"runtime_env": {"worker_process_setup_hook": "%s", "env_vars": {}}}' % nodes.HOOK
    assert "worker_process_setup_hook" not in jobs.driver_runtime_env({jobs.JOB_CONFIG_ENV: job})
    mod, fn = nodes.HOOK.rsplit(".", 1)
    assert getattr(__import__(mod, fromlist=[fn]), fn) is nodes.setup_worker


def test_config_paths_of_a_run(tmp_path):
    ns = lambda **kw: types.SimpleNamespace(**kw)  # noqa: E731
    args = ns(actor=ns(model_name_or_path="Qwen/Qwen2.5-7B"), data=ns(prompt_dataset=str(tmp_path / "d.jsonl")),
              div=ns(anchor_data="/shared/pre"), ckpt=ns(path="/shared/ckpt", output_dir=None),
              logger=ns(tensorboard_dir="/shared/tb"))
    got = nodes.config_paths(args)
    assert ("actor.model_name_or_path", "Qwen/Qwen2.5-7B", "in") not in got  # a hub id
    assert got == [("data.prompt_dataset", str(tmp_path / "d.jsonl"), "in"), ("div.anchor_data", "/shared/pre", "in"),
                   ("ckpt.path", "/shared/ckpt", "out"), ("logger.tensorboard_dir", "/shared/tb", "out")]
    assert ("div.anchor_data", "/shared/pre", "in") not in nodes.config_paths(args, skip=("div.anchor_data",))


def test_lost_node_message_is_one_line_naming_the_node():
    msg = nodes.lost_node_message({"NodeManagerHostname": "nodeB", "NodeManagerAddress": "10.200.0.2"})
    assert "\n" not in msg and "nodeB (10.200.0.2)" in msg and "--ckpt.load_enable" in msg


def test_watchdog_names_a_node_that_was_alive_and_died(monkeypatch):
    import threading

    import ray

    a = {"NodeID": "a", "Alive": True, "NodeManagerHostname": "nodeA", "NodeManagerAddress": "10.200.0.1"}
    b = {"NodeID": "b", "Alive": True, "NodeManagerHostname": "nodeB", "NodeManagerAddress": "10.200.0.2"}
    c_dead = {"NodeID": "c", "Alive": False}  # dead before the run: not ours to report
    tables = iter([[a, b, c_dead], [a, b, c_dead], [a, dict(b, Alive=False), c_dead]])
    last = []
    monkeypatch.setattr(ray, "nodes", lambda: last.append(next(tables, None) or last[-1]) or last[-1])
    seen, done = [], threading.Event()
    t = nodes.watch_nodes(0.01, environ={}, on_lost=lambda n: (seen.append(n["NodeManagerHostname"]), done.set()))
    assert done.wait(5) and seen == ["nodeB"]
    t.thread.join(5)
    assert nodes.watch_nodes(environ={nodes.WATCH_VAR: "0"}) is None
