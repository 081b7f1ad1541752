"""A job on a real multi-node Ray cluster, on this machine: a head and five worker nodes, each its
own raylet with its own node IP in 127.0.0.0/8 (``ray.cluster_utils.Cluster``). The job's ranks
are reserved in one placement group spread over the nodes; the rollout and the trainer run at tp=2,
their peer ranks meeting rank 0 at its node's IP; every role service binds its node's IP
(``--service-host node``). The job reaches logdiff 0 on every step. Then a node holding some of the
job's ranks is removed mid-job: the loss is reported as a job event naming the node and its ranks
within seconds, the ranks are placed again on the remaining nodes, and the job resumes to final
weights bitwise equal to an uninterrupted run's. Loopback only, bounded in time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from onpolicy.jobs.spec import load_spec_file, parse_spec
from onpolicy.services.controller.records import JobState

ROOT = Path(__file__).resolve().parents[3]
STEPS = 3
WORKERS = tuple(f"127.0.0.{i}" for i in range(2, 7))  # one node per rank: SPREAD puts each rank on its own


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from onpolicy.services.cluster.local_ray import shutdown_ray

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                                                      "include_dashboard": False})
    nodes = {ip: c.add_node(num_cpus=3, node_ip_address=ip) for ip in WORKERS}
    c.wait_for_nodes()
    ray.init(address=c.address, _node_ip_address="127.0.0.1", log_to_driver=False)  # the driver is on the head
    yield c, nodes
    shutdown_ray()
    c.shutdown()


def spec():
    raw = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    raw.update(steps=STEPS, checkpoint={"dir": "", "interval": 1},
               parallel={"rollout": {"tp": 2}, "trainer": {"tp": 2}, "placement": "spread"})
    return parse_spec(raw)


def controller(state: Path):
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.controller.controller import JobController

    return JobController(state, RayLauncher(host="node", state_dir=state, max_restarts=3))


def final_weights(state: Path, job_id: str) -> dict[str, torch.Tensor]:
    return load_file(state / "jobs" / job_id / "weights" / f"weights-v{STEPS:06d}.safetensors")


def job_nodes(job_id: str) -> dict[str, str]:
    """Each of the job's live Ray actors (services and peer ranks) -> the IP of its node (from the GCS)."""
    import ray._private.state as ray_state

    return {a["Name"]: a["Address"]["IPAddress"] for a in ray_state.actors().values()
            if a.get("State") == "ALIVE" and (a.get("Name") or "").startswith(f"onpolicy-{job_id}-")}


def steps_of(ctl, job_id: str):
    return [e for e in ctl._job(job_id).events if e.weight_version and not e.message]


def submit_and_reach_step_1(ctl) -> str:
    """Submit the job and wait (at most 300 s) until its first step is done; its id."""
    job_id = ctl.submit(spec()).job_id
    deadline = time.monotonic() + 300
    while ctl.get(job_id).step < 1:
        assert time.monotonic() < deadline and not ctl.get(job_id).state.terminal, ctl.get(job_id).error
        time.sleep(0.2)
    return job_id


def test_tp2_roles_span_nodes_with_logdiff_zero_and_survive_a_lost_node(cluster, tmp_path: Path) -> None:
    c, nodes = cluster
    base_state = tmp_path / "baseline"
    ctl = controller(base_state)
    job_id = submit_and_reach_step_1(ctl)
    placed = job_nodes(job_id)
    rec = ctl.wait(job_id, timeout=600)
    assert rec.state is JobState.SUCCEEDED, rec.error
    steps = steps_of(ctl, job_id)
    assert [e.step for e in steps] == list(range(1, STEPS + 1))
    assert all(e.logdiff_max == 0.0 and e.tokens_mismatched == 0 and e.tokens_checked > 0 for e in steps)
    assert set(placed.values()) <= set(WORKERS)  # the head holds no CPUs: every rank on a worker node
    for role in ("rollout", "trainer"):  # each tp=2 role's service and its peer rank on different nodes
        service = placed[f"onpolicy-{job_id}-{role}"]
        peers = [ip for name, ip in placed.items() if name.startswith(f"onpolicy-{job_id}-{role}-")]
        assert len(peers) == 1 and peers[0] != service, (role, placed)
    baseline = final_weights(base_state, job_id)
    ctl.shutdown()

    state = tmp_path / "killed"
    ctl = controller(state)
    job_id = submit_and_reach_step_1(ctl)
    victim = job_nodes(job_id)[f"onpolicy-{job_id}-trainer"]
    c.remove_node(nodes[victim])
    removed = time.time()
    rec = ctl.wait(job_id, timeout=900)
    assert rec.state is JobState.SUCCEEDED, rec.error
    events = ctl._job(job_id).events
    lost = [e for e in events if e.message.startswith(f"lost node {victim} (")]
    assert len(lost) == 1 and "trainer" in lost[0].message, "\n".join(e.message for e in events)
    assert lost[0].timestamp - removed < 10, "the lost node was not reported within seconds"
    assert [e.step for e in steps_of(ctl, job_id)][-1] == STEPS
    assert all(e.logdiff_max == 0.0 and e.tokens_mismatched == 0 for e in steps_of(ctl, job_id))
    got = final_weights(state, job_id)
    assert got.keys() == baseline.keys() and all(torch.equal(got[k], baseline[k]) for k in got)
    ctl.shutdown()
