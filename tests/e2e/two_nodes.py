"""Two real Ray nodes on one Linux machine, built from namespaces (the ``two_nodes`` tests).

Each node is a network namespace (node A ``10.200.0.1``, node B ``10.200.0.2``, joined by one veth
pair named ``eth0`` on both sides, no route anywhere else) plus a pid, mount and uts namespace whose
PID 1 is a small reaping init. Per node: its own hostname (``nodeA``/``nodeB``), ``/etc/hosts``
(the other node's name resolves to its veth address, the node's own name to ``127.0.1.1`` as
Debian/Ubuntu install it -- the classic trap for gloo; ``loopback_hostname=False`` maps it to the
veth address instead), ``/tmp`` (a host folder bind-mounted there) and
``/dev/shm`` (a tmpfs: Ray's object store). What both nodes see, as on a real cluster with a shared
filesystem: everything outside ``/tmp`` and ``/dev/shm`` -- the repository and its venv under
``/work`` and the *shared* folder (:attr:`TwoNodes.shared`, under ``/var/tmp``), which the tests
use for the model, data, pre-sampling output and checkpoints.

Node A runs the Ray head (GCS, dashboard, job server), node B a Ray worker node; jobs are
submitted from node A with the project's launcher (``examples/scripts/run.sh ... --submit``: real
``ray job submit``). Everything the harness creates is torn down by :meth:`TwoNodes.stop` (also
on a failed start, on Ctrl-C and on SIGTERM): each node's init is killed, which makes the kernel
kill every process of that node's pid namespace (so no ``ray stop`` is ever needed, and no other
Ray cluster on the machine is touched), then the namespaces and the folders are removed.

Namespace names carry the creating process's pid (``odiv2n-A-<pid>``), so parallel runs do not
collide and a run killed with SIGKILL is cleaned up by the next one (:func:`sweep_stale`).
Needs root (``ip netns``, ``unshare``, ``nsenter``); :func:`unavailable` says in one line why not.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import ray_harness

PREFIX = "odiv2n"
ADDR = {"A": "10.200.0.1", "B": "10.200.0.2"}
GCS_PORT = 6379  # fixed: each node has its own network namespace, nothing else listens there
DASHBOARD_PORT = 8265
HEAD = ADDR["A"]

# PID 1 of a node: hostname, /etc/hosts, private /tmp and /dev/shm, then reap until SIGTERM.
_INIT = r"""
import os, signal, subprocess, sys, time
node, root, shm, loopback = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
subprocess.run(["hostname", "node" + node], check=True)
hosts = os.path.join(root, "hosts")
with open(hosts, "w") as fh:
    fh.write("127.0.0.1 localhost\n")
    for n, ip in (("A", "10.200.0.1"), ("B", "10.200.0.2")):
        # loopback: the node's own name on 127.0.1.1 as Debian/Ubuntu install it
        fh.write(f"{'127.0.1.1' if loopback and n == node else ip} node{n}\n")
subprocess.run(["mount", "--bind", hosts, "/etc/hosts"], check=True)
subprocess.run(["mount", "--rbind", os.path.join(root, "tmp"), "/tmp"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={shm},mode=1777", "tmpfs", "/dev/shm"], check=True)
print("ready", flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
signal.signal(signal.SIGINT, lambda *a: sys.exit(0))
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.5)
"""


def _run(cmd: Sequence[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def unavailable() -> str:
    """Why two namespace nodes cannot be made here ('' when they can)."""
    if not sys.platform.startswith("linux"):
        return f"two namespace nodes need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "two namespace nodes need root (ip netns / unshare / nsenter); run as root or skip -m two_nodes"
    for tool in ("ip", "unshare", "nsenter", "hostname", "mount"):
        if shutil.which(tool) is None:
            return f"two namespace nodes need `{tool}` (iproute2 / util-linux) on PATH"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace here (`ip netns add`: {r.stdout.strip()[:160]})"
    _run(["ip", "netns", "del", probe], check=False)
    r = _run(["unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc", "true"], check=False)
    if r.returncode != 0:
        return f"cannot create pid/mount/uts namespaces here (`unshare`: {r.stdout.strip()[:160]})"
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def sweep_stale() -> List[str]:
    """Remove the namespaces of earlier runs whose creating process is gone (a SIGKILLed pytest):
    only ``odiv2n-*-<pid>`` names, i.e. ours; returns the names removed."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    gone = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != PREFIX or not parts[2].isdigit() or _pid_alive(int(parts[2])):
            continue
        pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run(["ip", "netns", "del", name], check=False)
        gone.append(name)
    return gone


@dataclass
class NodeResult:
    returncode: int
    output: str


class TwoNodes:
    """Node A (Ray head) + node B (Ray worker) from namespaces; see the module doc.

    ``gpus``: logical GPUs each node declares (OpenRLHF's placement groups ask for GPUs; each
    engine's bundle lands on one node, so the counts decide which role fits where)."""

    def __init__(self, *, gpus: Dict[str, int] = None, cpus: int = 8, shm: str = "1g",
                 object_store_bytes: int = 300_000_000, keep_logs: Optional[str] = None,
                 probe: bool = True, env: Optional[Dict[str, str]] = None, loopback_hostname: bool = True):
        self.gpus = dict(gpus or {"A": 1, "B": 1})
        self.cpus, self.shm, self.object_store_bytes = cpus, shm, object_store_bytes
        self.keep_logs, self.probe = keep_logs, probe
        self.extra_env = dict(env or {})
        self.loopback_hostname = loopback_hostname
        tag = str(os.getpid())
        self.netns = {n: f"{PREFIX}-{n}-{tag}" for n in "AB"}
        self.root = tempfile.mkdtemp(prefix=f"{PREFIX}-nodes-", dir="/tmp")          # per-node /tmp backing
        self.shared = tempfile.mkdtemp(prefix=f"{PREFIX}-shared-", dir="/var/tmp")   # the "shared filesystem"
        os.chmod(self.shared, 0o755)
        self.unshare: Dict[str, subprocess.Popen] = {}
        self.init_pid: Dict[str, int] = {}
        self._stopped = False
        self._old_sigterm = None
        self.timings: Dict[str, float] = {}

    # ---------------------------------------------------------------- paths
    def node_tmp(self, node: str) -> str:
        """The host folder behind ``node``'s ``/tmp`` (the host can look, the other node cannot)."""
        return os.path.join(self.root, node, "tmp")

    @property
    def address(self) -> str:
        return f"http://{HEAD}:{DASHBOARD_PORT}"

    # ---------------------------------------------------------------- environment of every node process
    def env(self, node: str) -> Dict[str, str]:
        # the single-node harness's cluster environment (CPU seams, probe, vLLM CPU settings)...
        env = ray_harness.RayHead.env(types.SimpleNamespace(probe=self.probe, extra_env={}))
        env.pop("RAY_ADDRESS", None)
        # ...minus what is the host's: its own /tmp, its home (under the host's /tmp in CI)
        for k in ("TMPDIR", "TMP", "TEMP", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER",
                  "PYTEST_XDIST_WORKER_COUNT", "RAY_TMPDIR", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
            env.pop(k, None)
        env["HOME"] = "/tmp/home"
        env.update(self.extra_env)
        return env

    # ---------------------------------------------------------------- running commands on a node
    def cmd(self, node: str, argv: Sequence[str], env: Optional[Dict[str, str]] = None) -> List[str]:
        e = self.env(node)
        e.update(env or {})
        return (["nsenter", "-t", str(self.init_pid[node]), "-n", "-m", "-u", "-p", "--wd=/tmp", "env", "-i"]
                + [f"{k}={v}" for k, v in e.items()] + list(argv))

    def run(self, node: str, argv: Sequence[str], *, env: Optional[Dict[str, str]] = None,
            timeout: float = 600, cwd: Optional[str] = None) -> NodeResult:
        argv = list(argv)
        if cwd:
            argv = ["bash", "-c", 'cd "$0" && exec "$@"', cwd] + argv
        p = subprocess.run(self.cmd(node, argv, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout)
        return NodeResult(p.returncode, p.stdout)

    def popen(self, node: str, argv: Sequence[str], *, env: Optional[Dict[str, str]] = None,
              cwd: Optional[str] = None, log=None) -> subprocess.Popen:
        argv = list(argv)
        if cwd:
            argv = ["bash", "-c", 'cd "$0" && exec "$@"', cwd] + argv
        return subprocess.Popen(self.cmd(node, argv, env), stdout=log or subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def python(self, node: str, code: str, *, timeout: float = 300) -> NodeResult:
        return self.run(node, [sys.executable, "-c", code], timeout=timeout)

    def submit(self, exp, *args: str, run_dir: str, presample_dir: Optional[str] = None,
               timeout: float = 900, extra_env: Optional[Dict[str, str]] = None,
               script: str = "examples/scripts/run.sh") -> "ray_harness.JobResult":
        """``bash examples/scripts/run.sh ARGS`` on node A against the head (real ``ray job submit``),
        with the experiment's variables, like :func:`ray_harness.submit` on one node."""
        env = dict(exp.env)
        env.update({"RAY_ADDRESS": self.address, "PYTHON": sys.executable, "RUN_DIR": run_dir})
        if presample_dir:
            env["PRESAMPLE_DIR"] = presample_dir
        env.update(extra_env or {})
        r = self.run("A", ["bash", os.path.join(ray_harness.REPO, script), *args], env=env,
                     cwd=ray_harness.REPO, timeout=timeout)
        return ray_harness.JobResult(r.returncode, r.output, run_dir)

    def actor_nodes(self, job_output: Optional[str] = None) -> Dict[str, List[str]]:
        """``{actor class name: ["A"|"B" (the node it ran on), ...]}`` of every actor the cluster
        has seen (Ray's state API, asked on node A); with ``job_output`` (what ``ray job submit``
        printed) only the actors that job's driver made."""
        job = ""
        if job_output is not None:
            import re

            ids = re.findall(r"raysubmit_[A-Za-z0-9]+", job_output)
            assert ids, job_output[-3000:]
            job = ids[-1]
        code = (
            "import json, ray\n"
            "from ray.job_submission import JobSubmissionClient\n"
            "from ray.util.state import list_actors, list_nodes\n"
            f"ray.init(address='{HEAD}:{GCS_PORT}', logging_level='ERROR', log_to_driver=False)\n"
            f"job = '{job}' and JobSubmissionClient('{self.address}').get_job_info('{job}').job_id\n"
            "ip = {n.node_id: n.node_ip for n in list_nodes(limit=100)}\n"
            "out = {}\n"
            "for a in list_actors(limit=10000, detail=True):\n"
            "    if not job or a.job_id == job:\n"
            "        out.setdefault(a.class_name, []).append(ip.get(a.node_id, '?'))\n"
            "print('ACTORS ' + json.dumps(out))\n")
        r = self.python("A", code)
        line = next((ln for ln in r.output.splitlines() if ln.startswith("ACTORS ")), None)
        assert line, r.output[-3000:]
        names = {v: k for k, v in ADDR.items()}
        return {k: sorted(names.get(ip, ip) for ip in v) for k, v in json.loads(line[7:]).items()}

    def job_driver_node(self, output: str) -> str:
        """The node ("A"/"B") whose driver ran the job a ``ray job submit`` ``output`` names (Ray's
        job table: ``driver_node_id``)."""
        import re

        ids = re.findall(r"raysubmit_[A-Za-z0-9]+", output)
        assert ids, output[-3000:]
        code = (
            "from ray.job_submission import JobSubmissionClient\n"
            "from ray.util.state import list_nodes\n"
            "import ray\n"
            f"ray.init(address='{HEAD}:{GCS_PORT}', logging_level='ERROR', log_to_driver=False)\n"
            f"info = JobSubmissionClient('{self.address}').get_job_info('{ids[-1]}')\n"
            "ip = {n.node_id: n.node_ip for n in list_nodes(limit=100)}\n"
            "print('DRIVER ' + str(ip.get(info.driver_node_id)))\n")
        r = self.python("A", code)
        line = next((ln for ln in r.output.splitlines() if ln.startswith("DRIVER ")), None)
        assert line, r.output[-3000:]
        return {v: k for k, v in ADDR.items()}.get(line.split()[1], line.split()[1])

    # ---------------------------------------------------------------- link control (node loss)
    def link(self, node: str, up: bool) -> None:
        _run(["ip", "-n", self.netns[node], "link", "set", "eth0", "up" if up else "down"])

    def rejoin(self, node: str = "B", timeout: float = 600) -> None:
        """Bring ``node`` back after a cut: its link up, its Ray processes (which the GCS declared
        dead) stopped inside its own pid namespace, a fresh worker node started; waits for two
        alive nodes."""
        self.link(node, True)
        self.run(node, [os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"], timeout=120)
        self._ray(timeout, head=False)

    def restart_worker(self, gpus: int, timeout: float = 600) -> None:
        """Node B's raylet stopped (gracefully: the GCS drops it at once) and started again declaring
        ``gpus`` logical GPUs; waits for two alive nodes holding the new total."""
        self.link("B", True)
        self.run("B", [os.path.join(os.path.dirname(sys.executable), "ray"), "stop"], timeout=120)
        self.gpus["B"] = gpus
        self._ray(timeout, head=False)

    # ---------------------------------------------------------------- start / stop
    def start(self, timeout: float = 600) -> "TwoNodes":
        atexit.register(self.stop)
        if threading_main():
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            sweep_stale()
            t0 = time.time()
            self._network()
            self._nodes()
            self.timings["namespaces_s"] = time.time() - t0
            self._ray(timeout)
            self.timings["ready_s"] = time.time() - t0
        except BaseException:
            self.stop()
            raise
        return self

    def _on_sigterm(self, *_):
        self.stop()
        raise SystemExit(143)

    def _network(self) -> None:
        a, b = self.netns["A"], self.netns["B"]
        _run(["ip", "netns", "add", a])
        _run(["ip", "netns", "add", b])
        # veth ends named by pid on the host side for the instant they exist there
        va, vb = f"od{os.getpid()}a"[-15:], f"od{os.getpid()}b"[-15:]
        _run(["ip", "link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b])
        for node, ns, v in (("A", a, va), ("B", b, vb)):
            _run(["ip", "-n", ns, "link", "set", v, "name", "eth0"])
            _run(["ip", "-n", ns, "addr", "add", f"{ADDR[node]}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    def _nodes(self) -> None:
        for node in "AB":
            root = os.path.join(self.root, node)
            os.makedirs(os.path.join(root, "tmp", "home"), exist_ok=True)
            os.chmod(os.path.join(root, "tmp"), 0o1777)
            log = open(os.path.join(root, "init.log"), "w")
            self.unshare[node] = subprocess.Popen(
                ["ip", "netns", "exec", self.netns[node], "unshare", "--mount", "--uts", "--pid", "--fork",
                 "--mount-proc", "--propagation", "private", sys.executable, "-c", _INIT, node, root, self.shm,
                 "1" if self.loopback_hostname else "0"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        for node in "AB":
            log = os.path.join(self.root, node, "init.log")
            u = self.unshare[node]
            deadline = time.time() + 60
            while time.time() < deadline:
                if "ready" in open(log).read():
                    break
                if u.poll() is not None:
                    raise RuntimeError(f"node {node} init exited {u.returncode}: {open(log).read()[-2000:]}")
                time.sleep(0.05)
            else:
                raise TimeoutError(f"node {node} init not ready in 60 s: {open(log).read()[-2000:]}")
            # ip netns exec execs unshare (same pid); unshare forks the init
            with open(f"/proc/{u.pid}/task/{u.pid}/children") as fh:
                self.init_pid[node] = int(fh.read().split()[0])

    def _ray(self, timeout: float, head: bool = True) -> None:
        common = ["--num-cpus", str(self.cpus), "--temp-dir", "/tmp/ray", "--disable-usage-stats",
                  "--object-store-memory", str(self.object_store_bytes)]
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        head_cmd = [ray_bin, "start", "--head", "--node-ip-address", HEAD, "--port", str(GCS_PORT),
                "--include-dashboard=true", "--dashboard-host", HEAD, "--dashboard-port", str(DASHBOARD_PORT),
                "--num-gpus", str(self.gpus["A"]), "--resources", json.dumps({"nodeA": 1})] + common
        worker = [ray_bin, "start", "--address", f"{HEAD}:{GCS_PORT}", "--node-ip-address", ADDR["B"],
                  "--num-gpus", str(self.gpus["B"]), "--resources", json.dumps({"nodeB": 1})] + common
        t0 = time.time()
        if head:
            r = self.run("A", head_cmd, timeout=timeout)
            if r.returncode != 0:
                raise RuntimeError(f"ray start --head on node A exited {r.returncode}:\n{r.output[-3000:]}")
            self.timings["head_s"] = time.time() - t0
        t0 = time.time()
        r = self.run("B", worker, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"ray start on node B exited {r.returncode}:\n{r.output[-3000:]}")
        # both raylets registered and the job server answering
        wait = (
            "import json, time, urllib.request, ray\n"
            f"ray.init(address='{HEAD}:{GCS_PORT}', logging_level='ERROR', log_to_driver=False)\n"
            f"t = time.time()\n"
            f"while (sum(n['Alive'] for n in ray.nodes()) != 2 or ray.cluster_resources().get('GPU', 0) != "
            f"{sum(self.gpus.values())}) and time.time() - t < {timeout}: time.sleep(0.5)\n"
            "alive = [(n['NodeManagerAddress'], n['NodeManagerHostname']) for n in ray.nodes() if n['Alive']]\n"
            f"while time.time() - t < {timeout}:\n"
            "    try:\n"
            f"        urllib.request.urlopen('http://{HEAD}:{DASHBOARD_PORT}/api/version', timeout=5); break\n"
            "    except OSError: time.sleep(1)\n"
            "print('ALIVE ' + json.dumps(alive))\n")
        r = self.python("A", wait, timeout=timeout + 60)
        line = next((ln for ln in r.output.splitlines() if ln.startswith("ALIVE ")), None)
        alive = json.loads(line[6:]) if line else []
        if len(alive) != 2:
            raise RuntimeError(f"two alive Ray nodes expected, got {alive}:\n{r.output[-3000:]}")
        self.nodes = alive
        self.timings["worker_s" if head else "rejoin_s"] = time.time() - t0

    def logs(self, node: str) -> str:
        """Node ``node``'s Ray session logs folder, as the host sees it (``session_latest`` is a link
        to the path inside the node)."""
        ray_tmp = os.path.join(self.node_tmp(node), "ray")
        try:
            session = os.path.basename(os.readlink(os.path.join(ray_tmp, "session_latest")))
        except OSError:
            session = "session_latest"
        return os.path.join(ray_tmp, session, "logs")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._old_sigterm is not None and threading_main():
            signal.signal(signal.SIGTERM, self._old_sigterm)
        if self.keep_logs:
            for node in "AB":
                src = self.logs(node)
                if os.path.isdir(src):
                    shutil.copytree(src, os.path.join(self.keep_logs, f"node{node}"), dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("*.sock", "events"), symlinks=False,
                                    ignore_dangling_symlinks=True)
        for node in "BA":
            pid = self.init_pid.get(node)
            if pid and _pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)  # PID 1 gone: the kernel kills the node's whole pid namespace
                except ProcessLookupError:
                    pass
        for node, u in self.unshare.items():
            try:
                u.wait(timeout=30)
            except subprocess.TimeoutExpired:
                u.kill()
        for node, ns in self.netns.items():
            if ns in _run(["ip", "netns", "list"], check=False).stdout:
                left = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
                for p in left:  # e.g. an nsenter'ed command whose node init is already gone
                    try:
                        os.kill(int(p), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                if left:
                    time.sleep(0.5)
                _run(["ip", "netns", "del", ns], check=False)
        for d in (self.root, self.shared):
            _rmtree(d)
        try:
            atexit.unregister(self.stop)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass

    def leftovers(self) -> List[str]:
        """What of this cluster still exists after :meth:`stop` (empty when all is gone)."""
        out = []
        names = _run(["ip", "netns", "list"], check=False).stdout
        out += [f"netns {ns}" for ns in self.netns.values() if ns in names]
        out += [f"pid {p}" for p in list(self.init_pid.values()) + [u.pid for u in self.unshare.values()]
                if _pid_alive(p) and not _zombie(p)]
        out += [f"dir {d}" for d in (self.root, self.shared) if os.path.exists(d)]
        return out

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _rmtree(d: str) -> None:
    if os.path.isdir(d):
        subprocess.run(["rm", "-rf", "--one-file-system", d], check=False)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
