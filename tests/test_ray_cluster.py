"""Ray on a cluster of nodes on this machine (ray.cluster_utils.Cluster: a head without CPUs and worker
nodes of one CPU each, every node a process here), through the pool --ray ADDRESS --workers 2 uses: the
actors spread over the nodes, and a node removed mid-run loses no batch (its batches run again on a
live worker): calibrate's statistics and quantize's model are byte-identical to one process, whether
the cluster has room for a replacement worker or not. One case runs by default (about 15 s: a cluster
starts in seconds a node); the others with -m slow."""

from __future__ import annotations

import pytest

import fp8onnx
from fp8onnx.pipeline import distributed

from helpers import SAMPLE

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray  # Ray workers: left out of the default suite, CI's own step (-m ray)
CALIB = SAMPLE / "calib.npz"
SLOW = pytest.mark.slow  # the default suite removes one node mid-run; the rest run with -m slow


def _cases(*params, default):
    return [pytest.param(*p, marks=() if p == default else SLOW, id="-".join(map(str, p))) for p in params]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    distributed.close_all()
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    c.wait_for_nodes()
    yield c
    distributed.close_all()
    ray.shutdown()
    c.shutdown()


def _nodes(c, alive: int) -> None:
    """Exactly ``alive`` one-CPU worker nodes."""
    while len(c.worker_nodes) < alive:
        c.add_node(num_cpus=1)
    while len(c.worker_nodes) > alive:
        c.remove_node(next(iter(c.worker_nodes)))
    c.wait_for_nodes()


def _remove_a_busy_node(monkeypatch, c, at: int) -> dict:
    """Remove the node of a worker when the ``at``-th batch is submitted."""
    state = {"n": 0, "removed": None}
    real = distributed.WorkerPool._submit

    def submit(self, pending, load, task, item, index, keep, tries):
        state["n"] += 1
        if state["removed"] is None and state["n"] == at:
            busy = {n for n in self._nodes if n is not None}
            assert len(busy) == len(self.workers), "the actors share a node"  # each reserves its CPU
            victim = next(n for n in c.worker_nodes if n.node_id in busy)
            c.remove_node(victim)
            state["removed"] = victim.node_id
        return real(self, pending, load, task, item, index, keep, tries)

    monkeypatch.setattr(distributed.WorkerPool, "_submit", submit)
    return state


@pytest.mark.parametrize(
    ("when", "room"),
    _cases(*[(w, r) for w in (0.1, 0.5, 0.9) for r in ("spare-node", "no-room")], default=(0.5, "no-room")),
)
def test_a_lost_node_loses_no_batch_in_calibrate(cluster, tmp_path, monkeypatch, when, room):
    """With a spare node the lost worker comes back there (Ray restarts the actor, or fp8onnx replaces
    it); without one the survivor takes every batch (the replacement waits for room and never holds the
    run up)."""
    c = cluster
    _nodes(c, 3 if room == "spare-node" else 2)
    one = fp8onnx.calibrate(SAMPLE / "decoder.onnx", CALIB, tmp_path / "one.json", provider="cpu", batch_size=1)
    state = _remove_a_busy_node(monkeypatch, c, max(1, int(one.num_batches * when)))
    two = fp8onnx.calibrate(
        SAMPLE / "decoder.onnx", CALIB, tmp_path / "two.json", provider="cpu", batch_size=1,
        workers=2, ray_address=c.address,
    )  # fmt: skip
    assert state["removed"] is not None and two.num_batches == one.num_batches
    assert (tmp_path / "one.json").read_bytes() == (tmp_path / "two.json").read_bytes()
    distributed.close_all()


@pytest.mark.parametrize("when", [pytest.param(w, marks=SLOW) for w in (0.1, 0.5, 0.9)])
def test_a_lost_node_loses_no_batch_in_quantize(cluster, tmp_path, monkeypatch, when):
    c = cluster
    _nodes(c, 3)
    fp8onnx.quantize(SAMPLE / "decoder.onnx", tmp_path / "one.onnx", CALIB, provider="cpu", batch_size=1)
    batches = 128  # calib.npz's samples, one a batch
    state = _remove_a_busy_node(monkeypatch, c, max(1, int(batches * when)))
    fp8onnx.quantize(
        SAMPLE / "decoder.onnx", tmp_path / "two.onnx", CALIB, provider="cpu", batch_size=1,
        workers=2, ray_address=c.address,
    )  # fmt: skip
    assert state["removed"] is not None
    assert (tmp_path / "one.onnx").read_bytes() == (tmp_path / "two.onnx").read_bytes()
    distributed.close_all()
