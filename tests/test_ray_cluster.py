"""Ray on a cluster of nodes on this machine (ray.cluster_utils.Cluster: a head without CPUs and worker
nodes of one CPU each, every node a process here), through the pool --ray ADDRESS --workers 2 uses: the
actors spread over the nodes, and a node removed mid-run loses no batch (its batches run again on a
live worker): the statistics are byte-identical to one process. Marked slow (a cluster starts in
about 10 s a node)."""

from __future__ import annotations

import pytest

import fp8onnx
from fp8onnx.pipeline import distributed

from helpers import SAMPLE

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    distributed.close_all()
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(4)]  # spares: one node is removed per run
    c.wait_for_nodes()
    yield c, nodes
    distributed.close_all()
    ray.shutdown()
    c.shutdown()


@pytest.mark.parametrize("when", [0.1, 0.5, 0.9])
def test_a_lost_node_loses_no_batch(cluster, tmp_path, monkeypatch, when):
    c, nodes = cluster
    calib = SAMPLE / "calib.npz"
    one = fp8onnx.calibrate(SAMPLE / "decoder.onnx", calib, tmp_path / "one.json", provider="cpu", batch_size=1)
    state = {"n": 0, "removed": None}
    real = distributed.WorkerPool._submit

    def submit(self, pending, load, task, item, index, keep, tries):
        state["n"] += 1
        if state["removed"] is None and state["n"] == max(1, int(one.num_batches * when)):
            busy = set(self._nodes)
            assert len(busy) == len(self.workers), "the actors share a node"  # each reserves its CPU
            victim = next(n for n in nodes if n.node_id in busy and n in c.worker_nodes)
            c.remove_node(victim)
            state["removed"] = victim.node_id
        return real(self, pending, load, task, item, index, keep, tries)

    monkeypatch.setattr(distributed.WorkerPool, "_submit", submit)
    two = fp8onnx.calibrate(
        SAMPLE / "decoder.onnx", calib, tmp_path / "two.json", provider="cpu", batch_size=1,
        workers=2, ray_address=c.address,
    )  # fmt: skip
    assert state["removed"] is not None and two.num_batches == one.num_batches
    assert (tmp_path / "one.json").read_bytes() == (tmp_path / "two.json").read_bytes()
    distributed.close_all()
