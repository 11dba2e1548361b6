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

import json
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


@pytest.fixture(scope="module")
def shared_experiment(cluster):
    import ray_harness

    return ray_harness.build_tiny_experiment(os.path.join(cluster.shared, "tiny"))


def _job(cluster, exp, method, run_dir, *args, presample_dir=None, ok=True, env=None, timeout=900):
    r = cluster.submit(exp, f"tiny_cpu_{method}", "--submit", *args, run_dir=run_dir, presample_dir=presample_dir,
                       extra_env=env, timeout=timeout)
    with open(os.path.join(cluster.shared, os.path.basename(run_dir) + ".log"), "a") as fh:
        fh.write(r.output)
    if ok:
        assert "succeeded" in r.output, f"job failed (rc {r.returncode}):\n{r.output[-6000:]}"
    return r


def test_dph_js_anchors_presampled_on_node_b_weights_synced_across_the_link(cluster, shared_experiment):
    """Job 1 (STAGES=presample, driver pinned to node B by RAY_ENTRYPOINT_RESOURCES) writes D_pef into
    the shared folder; job 2 (driver on node A) trains dph_js on those anchors. One logical GPU per
    node: the vLLM engine and the policy actor land on different nodes, so every weight broadcast
    (gloo) crosses the link; after each one vLLM's log-probs equal the actor's."""
    import ray_harness as h

    s = cluster.shared
    run, pre = os.path.join(s, "dph_js"), os.path.join(s, "presample")
    r = _job(cluster, shared_experiment, "dph_js", run, presample_dir=pre,
             env={"STAGES": "presample", "RAY_ENTRYPOINT_RESOURCES": '{"nodeB": 1}'})
    assert cluster.job_driver_node(r.output) == "B"
    summary = json.load(open(os.path.join(pre, "summary.json")))
    assert summary["complete"] and summary["n_pef"] > 0, summary
    # (the shared-path check made the output folders) no training logged anything
    assert not [f for _, _, fs in os.walk(run) for f in fs if f.startswith("events.out")], "STAGES=presample trained"

    r = _job(cluster, shared_experiment, "dph_js", run, presample_dir=pre)
    assert cluster.job_driver_node(r.output) == "A"
    # this job's actors only: the pre-sampling job made a vLLM engine too, on either node (CI once:
    # the two jobs' engines on different nodes)
    placed = cluster.actor_nodes(job_output=r.output)
    (engine_node,) = set(placed["RolloutRayActor"])
    policy = {k: v for k, v in placed.items() if "Policy" in k}
    assert policy and all(n != engine_node for v in policy.values() for n in v), placed
    sc = h.tb_scalars(os.path.join(run, "tb"))
    assert sorted(sc["train/rollout/reward_mean"]) == [1, 2]
    assert all(v > 0 for v in sc["train/rollout/num_anchor_samples"].values())
    assert all(v > 0 for v in sc["train/div/anchor_frac"].values())
    # logged (its value is 0 while the policy still equals the base model, e.g. when every step-1
    # sample was wrong: the JS anchor term and its gradient vanish at ratio 1)
    assert set(sc["train/div/loss_pef"]) == {1, 2}
    syncs = [r for r in h.probe_records(run) if r["event"] == "sync"]
    assert len(syncs) >= 2 and all(r["max_abs_diff"] < 0.1 for r in syncs), syncs
    assert max(abs(a - b) for a, b in zip(syncs[0]["vllm"], syncs[-1]["vllm"])) > 1e-3


_GLOO = r'''
import datetime, json, sys, ray
from openrlhf_div.engines.openrlhf import jobs

fixed = sys.argv[1] == "1"
# rank 0 (the TCPStore server) on node B, the worker node, and the rendezvous is rank 0's own node
# address, as OpenRLHF's and our actors' get_master_addr_port do. (A fixed 10.200.0.1 with a
# STRICT_SPREAD placement group left both ranks waiting on node A's port whenever bundle 0 landed on
# node B: CI twice; the passes were the other placement.) Each run has its own port.
port, wait = (29512, 90) if fixed else (29511, 20)
ray.init(address="10.200.0.1:6379", logging_level="ERROR", log_to_driver=False,
         runtime_env=jobs.driver_runtime_env({}) if fixed else None)

@ray.remote(num_cpus=1)
class Rank:
    def ip(self):
        return ray.util.get_node_ip_address()

    def run(self, rank, addr):
        import os, socket, time, torch, torch.distributed as dist
        t0 = time.time()
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=wait))
            t = torch.ones(3) * (rank + 1)
            dist.all_reduce(t)
            out = t.tolist()
        except Exception as e:
            out = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return {"host": socket.gethostname(), "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "result": out,
                "master": addr, "seconds": round(time.time() - t0, 1)}

ranks = [Rank.options(resources={node: 0.01}).remote() for node in ("nodeB", "nodeA")]
addr = ray.get(ranks[0].ip.remote(), timeout=180)
print("GLOO " + json.dumps(ray.get([r.run.remote(i, addr) for i, r in enumerate(ranks)], timeout=wait + 120)))
'''


def _gloo(cluster, fixed):
    r = cluster.run("A", [__import__("sys").executable, "-c", _GLOO, "1" if fixed else "0"], timeout=400)
    line = next((ln for ln in r.output.splitlines() if ln.startswith("GLOO ")), None)
    assert line, r.output[-3000:]
    return __import__("json").loads(line[5:])


def test_gloo_group_across_nodes_advertises_the_node_address(cluster):
    """Each node's own name resolves to 127.0.1.1 there: a gloo group across the nodes fails unless
    the run's worker setup hook (jobs.driver_runtime_env -> nodes.setup_worker) sets
    GLOO_SOCKET_IFNAME to the interface of the node's Ray address. Control first: the trap is armed."""
    bare = _gloo(cluster, fixed=False)
    assert sorted(x["host"] for x in bare) == ["nodeA", "nodeB"]
    assert any(isinstance(x["result"], str) for x in bare), bare  # no hook: gloo advertised loopback
    fixed = _gloo(cluster, fixed=True)
    assert [(x["host"], x["master"]) for x in fixed] == [("nodeB", "10.200.0.2"), ("nodeA", "10.200.0.2")], fixed
    assert [x["ifname"] for x in fixed] == ["eth0", "eth0"], fixed
    assert [x["result"] for x in fixed] == [[3.0, 3.0, 3.0]] * 2, fixed


def test_a_config_path_only_one_node_sees_stops_the_job_before_it_starts(cluster, shared_experiment):
    """RUN_DIR in node A's private /tmp: the training driver's check (nodes.check_shared_paths) names
    the path and node B in one line before any engine starts."""
    def engines():  # every actor but Ray's own JobSupervisor (one per submitted job)
        return sum(len(v) for k, v in cluster.actor_nodes().items() if k != "JobSupervisor")

    before = engines()
    # colocated reference (as the node-loss test): the job fits the two logical GPUs, so the launcher's
    # placement check passes and the shared-path check is what stops it
    r = _job(cluster, shared_experiment, "rkl", "/tmp/rkl_private", "--train.colocate_actor_ref", ok=False)
    line = next((ln for ln in r.output.splitlines() if "is not shared" in ln), "")
    assert "ckpt.path /tmp/rkl_private/ckpt is not shared: node nodeB (10.200.0.2)" in line, r.output[-4000:]
    assert "succeeded" not in r.output
    assert engines() == before  # no engine, no actor was made


#: seconds from cutting node B's link to the job's end: Ray's GCS marks a silent node dead after
#: about a minute (health checks), the driver's watchdog (nodes.watch_nodes) looks every 5 s
LOST_NODE_BOUND_S = 240


def test_rkl_job_losing_node_b_stops_in_one_line_and_resumes_from_its_checkpoint(cluster, shared_experiment):
    """rkl (a reference actor beside the policy, colocated on one logical GPU; the vLLM engine on the
    other node), 4 steps, a checkpoint after each; node B's link is cut during step 2: the job ends
    within LOST_NODE_BOUND_S with one line naming node B. With B back (link up, a fresh raylet), the
    same job with --ckpt.load_enable resumes at step 2 (from step 1's checkpoint) and finishes.

    The cut lands in step 2 by construction: the controller holds after step 2's rollout
    (tests/e2e/site/e2e_faults.py, OPENRLHF_DIV_E2E_FAULT_HOLD_STEP=2: after step 1's checkpoint,
    before step 2's training) and is never released. Without the hold a tiny step takes a fraction
    of a second, so a cut made on seeing step 1's checkpoint could land after step 2's (seen once:
    the resume then started at step 3)."""
    import time

    import ray_harness as h

    run = os.path.join(cluster.shared, "rkl")
    env = dict(shared_experiment.env, RAY_ADDRESS=cluster.address, PYTHON=__import__("sys").executable, RUN_DIR=run,
               OPENRLHF_DIV_E2E_FAULT_HOLD_STEP="2")
    log = open(os.path.join(cluster.shared, "rkl_cut.log"), "w+")
    p = cluster.popen("A", ["bash", os.path.join(h.REPO, "examples/scripts/run.sh"), "tiny_cpu_rkl", "--submit",
                            "--ckpt.save_steps", "1", "--train.colocate_actor_ref", "--train.num_episodes", "2"],
                      env=env, cwd=h.REPO, log=log)
    latest = os.path.join(run, "ckpt", "_actor", "latest")  # DeepSpeed writes it once a checkpoint is whole

    def step1_saved():
        try:
            return open(latest).read().strip() == "global_step1"
        except OSError:
            return False

    held = os.path.join(run, "fault_hold_step.pid")  # the controller waits in step 2 (never released)
    deadline = time.time() + 1200
    while not os.path.exists(held) and p.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert os.path.exists(held) and step1_saved(), open(log.name).read()[-6000:]
    cluster.link("B", False)
    t_cut = time.time()
    try:
        p.wait(timeout=LOST_NODE_BOUND_S + 120)
    finally:
        took = time.time() - t_cut
    out = open(log.name).read()
    lost = [ln for ln in out.splitlines() if "was lost mid-run" in ln]
    assert lost and "Ray node nodeB (10.200.0.2) was lost mid-run" in lost[0], out[-6000:]
    assert "succeeded" not in out and p.returncode != 0
    assert took < LOST_NODE_BOUND_S, f"the job took {took:.0f} s to end after the cut"
    print(f"job ended {took:.0f} s after node B's link was cut")

    cluster.rejoin("B")
    r = _job(cluster, shared_experiment, "rkl", run, "--ckpt.load_enable", "--train.colocate_actor_ref",
             "--ckpt.save_steps", "1", "--train.num_episodes", "2",
             "--logger.tensorboard_dir", os.path.join(run, "tb_resume"))
    sc = h.tb_scalars(os.path.join(run, "tb_resume"))
    assert sorted(sc["train/rollout/reward_mean"]) == [2, 3, 4], r.output[-3000:]
    assert all(v > 0 for v in sc["train/div/kl"].values()), sc["train/div/kl"]
    assert open(latest).read().strip() == "global_step4"
    placed = cluster.actor_nodes()  # both jobs: something of the run was on node B
    assert "B" in {n for k, v in placed.items() if k != "JobSupervisor" for n in v}, placed


#: the Megatron job across the nodes costs a node restart and a Megatron job (minutes on 2 cores):
#: it runs only when asked (docs/scaling.md, "Two nodes on one machine")
MEGATRON_VAR = "OPENRLHF_DIV_TWO_NODES_MEGATRON"


@pytest.mark.skipif(os.environ.get(MEGATRON_VAR) != "1",
                    reason=f"the two-node Megatron TP=2 job runs with {MEGATRON_VAR}=1")
def test_megatron_tp2_one_rank_on_each_node_weights_synced(cluster, shared_experiment):
    """configs/openrlhf/tiny_cpu_grpo_megatron.yaml split across the nodes: the policy is two
    Megatron-core Ray actors at TP=2, one on each node, so its TP group (gloo: every forward's and
    backward's all-reduces, the vocab-parallel loss, the gather of the TP shards before each weight
    sync) runs over the link between the nodes' network namespaces; each node's own name is
    loopback there, so this also needs the GLOO_SOCKET_IFNAME worker hook. After each sync vLLM's
    log-probs equal the Megatron forward's.

    Placement: node B is restarted declaring 2 logical GPUs (3 in all: 2 Megatron ranks + 1 vLLM
    engine). OpenRLHF makes the vLLM engine's placement group first; Ray's bundle scheduler puts a
    lone bundle on the least used node (B: half its GPUs left, A: none), then the actor's 2-bundle
    PACK group no longer fits one node and takes one GPU on each. The test asserts the placement."""
    import ray_harness as h

    cluster.restart_worker(gpus=2)
    run = os.path.join(cluster.shared, "grpo_megatron")
    # the two-node spelling of the layout (OpenRLHF's RayActorGroup makes the same 2 one-GPU bundles)
    r = _job(cluster, shared_experiment, "grpo_megatron", run, "--actor.num_nodes", "2",
             "--actor.num_gpus_per_node", "1")
    placed = cluster.actor_nodes(job_output=r.output)
    megatron = sorted(n for k, v in placed.items() if "Megatron" in k for n in v)
    assert megatron == ["A", "B"], placed
    sc = h.tb_scalars(os.path.join(run, "tb"))
    assert sorted(sc["train/rollout/reward_mean"]) == [1, 2]
    syncs = [rec for rec in h.probe_records(run) if rec["event"] == "sync"]
    assert len(syncs) >= 2 and all(rec["max_abs_diff"] < 0.1 for rec in syncs), syncs
    assert max(abs(a - b) for a, b in zip(syncs[0]["vllm"], syncs[-1]["vllm"])) > 1e-3
    print("megatron syncs max_abs_diff", [round(rec["max_abs_diff"], 4) for rec in syncs])
