"""What a run needs once its Ray cluster has more than one node (docs/scaling.md, "Running on
several nodes").

* **gloo's interface.** torch's gloo backend picks the address it advertises to its peers from
  the machine's hostname unless ``GLOO_SOCKET_IFNAME`` names an interface. On Debian/Ubuntu the
  hostname resolves to ``127.0.1.1`` (``/etc/hosts``): a process group across nodes then hands
  its peers a loopback address (one rank is refused, the other hangs until its timeout). Every
  gloo group of a run lives in a Ray worker (policy/reference actors and their TP groups, the
  weight-sync group between actor rank 0 and the vLLM engines, vLLM's own CPU groups), so
  :func:`setup_worker` -- Ray's ``worker_process_setup_hook`` of every run (:mod:`.jobs`) -- sets
  ``GLOO_SOCKET_IFNAME`` in each worker to the interface that carries the worker's Ray node
  address, unless the user set it. A user's ``GLOO_SOCKET_IFNAME`` (cluster-wide, e.g. ``eth0``)
  always wins.
* **Shared paths.** Ray moves objects between nodes, not files: a model, a data set, the
  pre-sampling output or a checkpoint folder must be at the same path on every node (a shared
  filesystem). :func:`check_shared_paths`, run by the drivers before any engine starts, asks every
  alive node (one zero-CPU Ray task pinned to each) whether it sees each input path and a marker
  file the driver wrote into each output folder, and stops with one line naming the path and the
  node that cannot see it. On a one-node cluster it does nothing.
"""
from __future__ import annotations

import ipaddress
import os
import uuid
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

GLOO_VAR = "GLOO_SOCKET_IFNAME"
#: set to 0 to leave GLOO_SOCKET_IFNAME alone (the hook then does nothing)
AUTO_VAR = "OPENRLHF_DIV_GLOO_IFNAME_AUTO"
HOOK = "openrlhf_div.engines.openrlhf.nodes.setup_worker"
#: set to 0 to skip the shared-path check (e.g. a filesystem whose writes take seconds to show)
CHECK_VAR = "OPENRLHF_DIV_CHECK_SHARED_PATHS"


# ------------------------------------------------------------------ gloo's interface
def interface_of(ip: str) -> Optional[str]:
    """The network interface that holds address ``ip`` on this machine (None if none does)."""
    import psutil  # a Ray dependency

    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.address.split("%")[0] == ip:
                return name
    return None


def _node_ip() -> Optional[str]:
    try:
        import ray

        worker = ray._private.worker.global_worker  # the address this worker's raylet was started with
        ip = getattr(worker, "node_ip_address", None)
        if ip:
            return ip
    except Exception:  # noqa: BLE001 - not inside a connected Ray worker
        pass
    return os.environ.get("RAY_NODE_IP_ADDRESS") or None


def gloo_interface(environ=None, node_ip: Optional[str] = None) -> Optional[str]:
    """The value :func:`setup_worker` gives ``GLOO_SOCKET_IFNAME`` (None: leave it unset)."""
    environ = os.environ if environ is None else environ
    if environ.get(GLOO_VAR) or environ.get(AUTO_VAR, "1") == "0":
        return None
    ip = node_ip or _node_ip()
    if not ip:
        return None
    try:
        if ipaddress.ip_address(ip).is_loopback:
            return None  # a one-machine cluster on 127.0.0.1: gloo's default is right
    except ValueError:
        return None
    return interface_of(ip)


def setup_worker() -> None:
    """Ray ``worker_process_setup_hook`` of every run: gloo advertises the node's Ray address."""
    iface = gloo_interface()
    if iface:
        os.environ[GLOO_VAR] = iface


# ------------------------------------------------------------------ shared paths
class SharedPathError(RuntimeError):
    """A path of the config that some node of the cluster cannot see (one line)."""


def config_paths(args, skip: Sequence[str] = ()) -> List[Tuple[str, str, str]]:
    """``(name, path, "in"|"out")`` of the local paths a run's nodes read or write, from the
    hierarchized OpenRLHF namespace (training and pre-sampling); ``skip``: names left out."""
    def get(dotted: str):
        obj = args
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj if isinstance(obj, str) and obj else None

    out = []
    for name, kind in (("actor.model_name_or_path", "in"), ("data.prompt_dataset", "in"),
                       ("div.anchor_data", "in"), ("ckpt.path", "out"), ("ckpt.output_dir", "out"),
                       ("logger.tensorboard_dir", "out"), ("presample.out", "out")):
        p = None if name in skip else get(name)
        if not p:
            continue
        if kind == "in" and not os.path.isabs(p) and not os.path.exists(p):
            continue  # a hub id (Qwen/Qwen2.5-7B), not a local path
        out.append((name, os.path.abspath(p), kind))
    return out


def _check_on_node(paths: Sequence[str]) -> Dict[str, bool]:
    return {p: os.path.exists(p) for p in paths}


def check_shared_paths(items: Iterable[Tuple[str, str, str]], environ=None) -> None:
    """Every alive node sees every input path and a file the driver wrote into every output folder;
    else :class:`SharedPathError` with one line naming the path and the node (see the module doc)."""
    import socket

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    environ = os.environ if environ is None else environ
    if environ.get(CHECK_VAR, "1") == "0":
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    items = list(items)
    here = f"{socket.gethostname()} ({_node_ip() or '?'})"
    probe: Dict[str, Tuple[str, str]] = {}  # path asked of every node -> (config name, what it is)
    markers = []
    try:
        for name, path, kind in items:
            if kind == "in":
                if not os.path.exists(path):
                    raise SharedPathError(f"{name} {path}: not found on the driver's node {here}")
                probe[path] = (name, path)
            else:
                os.makedirs(path, exist_ok=True)
                marker = os.path.join(path, f".openrlhf-div-shared-{uuid.uuid4().hex[:12]}")
                with open(marker, "w") as fh:
                    fh.write(here + "\n")
                markers.append(marker)
                probe[marker] = (name, path)
        task = ray.remote(num_cpus=0)(_check_on_node)
        refs = [(n, task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                 .remote(list(probe))) for n in nodes]
        for n, ref in refs:
            seen = ray.get(ref, timeout=300)
            for p, ok in seen.items():
                if ok:
                    continue
                name, path = probe[p]
                node = f"{n.get('NodeManagerHostname', '?')} ({n.get('NodeManagerAddress', '?')})"
                what = "does not see it" if p == path else f"does not see a file written there on {here}"
                raise SharedPathError(
                    f"{name} {path} is not shared: node {node} {what}; every node must see the same path "
                    "(a shared filesystem: docs/scaling.md, \"Running on several nodes\")")
    finally:
        for m in markers:
            try:
                os.remove(m)
            except OSError:
                pass


# ------------------------------------------------------------------ losing a node
#: seconds between two looks at the cluster's node table (0: no watchdog)
WATCH_VAR = "OPENRLHF_DIV_NODE_WATCH_S"
#: exit status of a driver stopped by :func:`watch_nodes`
LOST_NODE_EXIT = 3


def lost_node_message(node: Dict) -> str:
    return (f"error: Ray node {node.get('NodeManagerHostname', '?')} ({node.get('NodeManagerAddress', '?')}) "
            "was lost mid-run (marked dead by Ray's GCS); the run stops here. Bring the node back (ray start "
            "--address HEAD) and resume from the last checkpoint with --ckpt.load_enable")


def dead_since_start(start: Dict[str, Dict]) -> List[Dict]:
    """The nodes of ``start`` (``{NodeID: node}``, alive then) that Ray's GCS now marks dead."""
    import ray

    now = {n["NodeID"]: n for n in ray.nodes()}
    return [node for nid, node in start.items() if nid in now and not now[nid].get("Alive")]


class NodeWatch:
    """The nodes alive when a run started, and a daemon thread that ends the driver (exit status
    :data:`LOST_NODE_EXIT`) with one line naming the node when one of them is marked dead.

    Without it a lost node can leave the run waiting much longer than Ray's detection (about a
    minute): a gloo broadcast to an engine on that node blocks until gloo's own timeout (30 min by
    default). :meth:`explain` gives the same line to a driver whose main thread got Ray's error
    first (an actor on the lost node died)."""

    def __init__(self, interval: float, on_lost=None):
        import ray

        self.interval = interval
        self.start = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        self.on_lost = on_lost or self._exit
        self.thread = None

    @staticmethod
    def _exit(node: Dict) -> None:  # one line, then end the driver without waiting on the dead node
        import sys

        print(lost_node_message(node), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(LOST_NODE_EXIT)

    def explain(self) -> Optional[str]:
        try:
            dead = dead_since_start(self.start)
        except Exception:  # noqa: BLE001 - the GCS itself unreachable
            return None
        return lost_node_message(dead[0]) if dead else None

    def _loop(self) -> None:
        import time

        while True:
            time.sleep(self.interval)
            try:
                dead = dead_since_start(self.start)
            except Exception:  # noqa: BLE001 - the GCS itself unreachable: Ray's own error follows
                continue
            if dead:
                self.on_lost(dead[0])
                return

    def begin(self) -> "NodeWatch":
        import threading

        self.thread = threading.Thread(target=self._loop, name="openrlhf-div-node-watch", daemon=True)
        self.thread.start()
        return self


def watch_nodes(interval: Optional[float] = None, environ=None, on_lost=None) -> Optional[NodeWatch]:
    """Start a :class:`NodeWatch` looking every ``interval`` s (``OPENRLHF_DIV_NODE_WATCH_S``,
    default 5; 0 switches it off and returns None)."""
    environ = os.environ if environ is None else environ
    interval = float(environ.get(WATCH_VAR, "5") if interval is None else interval)
    if interval <= 0:
        return None
    return NodeWatch(interval, on_lost).begin()
