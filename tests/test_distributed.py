"""Statistics batches on Ray workers (fp8onnx.pipeline.distributed): the same bytes as one process.

Ray runs locally here (``ray.init(num_cpus=2)``, once for the module)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli import main
from fp8onnx.graph.runtime import worker_session
from fp8onnx.pipeline.statistics import reduce_batch as summarize

from helpers import SAMPLE, mlp_data, mlp_model

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray  # Ray workers: left out of the default suite, CI's own step (-m ray)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    from fp8onnx.pipeline.distributed import close_all

    close_all()
    ray.shutdown()


def _metrics(result) -> dict:
    """A compare result's JSON less its run-time measurements (time per batch, session memory),
    which are measured in this process only and differ from run to run."""
    doc = result.to_json()
    for row in doc["rows"]:
        row.pop("latency_ms"), row.pop("session_mib")
    return doc


def test_two_workers_write_the_same_statistics_and_model_as_one_process(tmp_path):
    """The sample decoder (a real TorchScript export, 29 MatMuls): amax and histograms from two
    workers merged in batch order are the single-process statistics, so the model is byte-identical."""
    model, calib = SAMPLE / "decoder.onnx", SAMPLE / "calib.npz"
    one = fp8onnx.calibrate(model, calib, tmp_path / "one.json", provider="cpu", batch_size=8)
    two = fp8onnx.calibrate(model, calib, tmp_path / "two.json", provider="cpu", batch_size=8, workers=2)
    assert two.num_batches == one.num_batches > 2
    assert (tmp_path / "one.json").read_bytes() == (tmp_path / "two.json").read_bytes()
    # batches sized to a 1-byte budget from one sample measured on a worker: one sample a run
    tiny = fp8onnx.calibrate(model, calib, tmp_path / "tiny.json", provider="cpu", batch_memory=1, workers=2)
    assert tiny.num_batches == tiny.num_samples and "sized to --batch-memory" in tiny.batching
    assert tiny.amax == pytest.approx(one.amax, rel=1e-6)  # one sample a run against 8: other kernels maybe
    fp8onnx.quantize(model, tmp_path / "one.onnx", calib, preset="none", provider="cpu")
    report = fp8onnx.quantize(model, tmp_path / "two.onnx", calib, preset="none", provider="cpu", workers=2)
    assert report.calibration["batches"] == one.num_batches // 2 + (one.num_batches % 2 > 0)
    assert (tmp_path / "one.onnx").read_bytes() == (tmp_path / "two.onnx").read_bytes()


def test_compare_and_study_on_two_workers_give_the_single_process_numbers(tmp_path):
    """compare: every metric (cosines, errors, top-1, accuracy and perplexity from labels, the FP16
    row) equal to the last bit; study: the same ranked table."""
    model = SAMPLE / "decoder.onnx"
    fp8onnx.quantize(model, tmp_path / "q.onnx", SAMPLE / "calib.npz", provider="cpu")
    one = fp8onnx.compare(model, [tmp_path / "q.onnx"], SAMPLE / "eval.npz", provider="cpu", batch_size=32)
    two = fp8onnx.compare(model, [tmp_path / "q.onnx"], SAMPLE / "eval.npz", provider="cpu", batch_size=32, workers=2)
    assert [r.name for r in two.rows] == ["FP32 (reference)", "FP16", "q.onnx"]
    assert one.rows[0].accuracy is not None and one.rows[2].perplexity is not None
    assert _metrics(two) == _metrics(one)
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    single = fp8onnx.study(path, data, data, provider="cpu")
    spread = fp8onnx.study(path, data, data, provider="cpu", workers=2)
    assert spread.to_json() == single.to_json()


def test_a_killed_worker_is_restarted_and_its_batch_rerun(tmp_path):
    from fp8onnx.graph.model_io import load_model
    from fp8onnx.graph.runtime import inline_proto, make_session
    from fp8onnx.passes import AMAX_SUFFIX, VALUE_SUFFIX, AddAmaxOutputsPass
    from fp8onnx.passes.common import keep_only_outputs
    from fp8onnx.pipeline.distributed import WorkerPool, close_all, fetch

    model = load_model(mlp_model(tmp_path / "m.onnx"))
    AddAmaxOutputsPass(["x", "h"], values=True)(model)
    outputs = [n + s for s in (AMAX_SUFFIX, VALUE_SUFFIX) for n in ("x", "h")]
    keep_only_outputs(model, outputs)
    blob = inline_proto(model).SerializeToString()
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((4, 16)).astype(np.float32) * (i + 1)} for i in range(12)]
    local = make_session(blob, "cpu")
    expected = [summarize(dict(zip(outputs, local.run(outputs, f)))) for f in feeds]
    close_all()  # the shared pool of the other tests holds both CPUs of the local Ray
    with WorkerPool(workers=2) as pool:
        pool.load(blob, worker_session, "cpu", "the test model")
        victim = ray.get(pool.workers[0].pid.remote())

        def feeding():
            for i, feed in enumerate(feeds):
                if i == 5:
                    os.kill(victim, signal.SIGKILL)  # mid-run, with batches queued on it
                yield feed

        got = list(pool.map(fetch, ((outputs, feed, summarize, "the test model") for feed in feeding())))
        assert ray.get(pool.workers[0].pid.remote()) != victim  # it was restarted
    assert len(got) == len(feeds)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for key in e:
            if key.endswith(AMAX_SUFFIX):
                # exact: one graph, one batch shape, one machine (onnxruntime splits a product over
                # threads by rows and columns, never along K: a worker's thread count changes no bit)
                assert g[key] == e[key]
            else:
                # exact: as above
                assert g[key][0] == e[key][0] and all(np.array_equal(a, b) for a, b in zip(g[key][1:], e[key][1:]))


def test_without_ray_the_message_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from click.testing import CliRunner

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    with pytest.raises(Fp8OnnxError, match=r"pip install 'fp8onnx\[ray\]'"):
        fp8onnx.calibrate(path, data, provider="cpu", workers=2)
    result = CliRunner().invoke(
        main, ["calibrate", str(path), "--calib", str(data), "-o", str(tmp_path / "s.json"), "--workers", "2"]
    )
    assert result.exit_code == 2 and "fp8onnx[ray]" in result.output
    assert not (tmp_path / "s.json").exists()


def crash_once(marker: str, value: int) -> int:
    """Kills its worker process the first time (no marker yet), then computes."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return value * 2


def test_zoo_tasks_on_ray_give_the_same_cells_and_a_dead_task_is_rerun(tmp_path):
    import sys

    from test_zoo import CONFIGS, small_zoo

    from fp8onnx.experiments.zoo import zoo
    from fp8onnx.pipeline.distributed import close_all, remote_tasks

    close_all()  # the tasks need the CPUs the shared pool holds
    folder = small_zoo(tmp_path / "zoo")
    here = zoo(folder, tmp_path / "here", configs=CONFIGS, provider="cpu")
    spread = zoo(folder, tmp_path / "ray", configs=CONFIGS, provider="cpu", workers=2)
    assert spread.ran == 3 and spread.models == here.models
    assert spread.configs == here.configs
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this file
    marker = str(tmp_path / "crashed")
    assert list(remote_tasks(crash_once, [(marker, 1), (marker, 2), (marker, 3)], workers=2)) == [2, 4, 6]
    assert os.path.exists(marker)


def test_a_model_with_external_data_goes_to_workers_as_file_references(tmp_path):
    """A Llama-style model whose weights live in a .data file: workers memory-map the weights from
    it (only the graph is serialized), and the statistics are the single-process ones."""
    from fp8onnx.graph.model_io import load_model
    from fp8onnx.graph.runtime import portable_model
    from fp8onnx.models.build_llama import build, write_data

    path = build(tmp_path / "llama", layers=1, dim=64, heads=2, ffn=128, vocab=256)
    write_data(tmp_path / "llama", 256, 16, 24, 8)
    graph, where = portable_model(load_model(path))
    assert where and all(isinstance(w, tuple) and w[0].endswith(".data") for w in where.values())
    assert len(graph) < 100_000  # the weights stay in their file
    calib = tmp_path / "llama" / "calib.npz"
    fp8onnx.calibrate(path, calib, tmp_path / "one.json", provider="cpu", batch_size=4)
    fp8onnx.calibrate(path, calib, tmp_path / "two.json", provider="cpu", batch_size=4, workers=2)
    assert (tmp_path / "one.json").read_bytes() == (tmp_path / "two.json").read_bytes()
    # layer by layer (a 64 KiB weight budget: one segment per few nodes): each segment's batches on the
    # workers, the tensors crossing a cut in Ray's object store - still the same statistics
    small = {"provider": "cpu", "batch_size": 4, "weight_memory": 64 << 10}
    fp8onnx.calibrate(path, calib, tmp_path / "seg1.json", **small)
    fp8onnx.calibrate(path, calib, tmp_path / "seg2.json", **small, workers=2)
    assert (tmp_path / "seg1.json").read_bytes() == (tmp_path / "seg2.json").read_bytes()


def test_a_model_that_does_not_load_on_the_workers_is_one_clear_sentence(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    good = mlp_model(tmp_path / "m.onnx")
    data = mlp_data(tmp_path / "d.npz")
    from fp8onnx.accuracy.on_workers import _worker_session
    from fp8onnx.pipeline.distributed import shared_pool

    with pytest.raises(Fp8OnnxError, match=r"Candidate model .*bad.onnx.* does not load in onnxruntime"):
        shared_pool(2, None).load(str(bad), _worker_session, "cpu", f"Candidate model {str(bad)!r}", ())
    result = fp8onnx.compare(good, [good], data, provider="cpu", workers=2)
    assert result.rows[-1].value == result.rows[0].value


def test_gptq_bias_correction_and_sensitivity_on_workers_match_one_process(tmp_path):
    """The in-graph statistics (GPTQ's X^T X, bias correction's means) and the sensitivity SQNR
    sums, per batch on the workers and added here in batch order: the same model, the same ranking."""
    model, calib = SAMPLE / "decoder.onnx", SAMPLE / "calib.npz"
    opts = {"provider": "cpu", "weight_rounding": "gptq", "bias_correction": True}
    fp8onnx.quantize(model, tmp_path / "one.onnx", calib, **opts)
    fp8onnx.quantize(model, tmp_path / "two.onnx", calib, **opts, workers=2)
    assert (tmp_path / "one.onnx").read_bytes() == (tmp_path / "two.onnx").read_bytes()
    one = fp8onnx.sensitivity(model, calib, provider="cpu")
    two = fp8onnx.sensitivity(model, calib, provider="cpu", workers=2)
    assert (two.samples, two.batches) == (one.samples, one.batches) == (128, 8)
    assert sum(r.sqnr_db is not None for r in one.nodes) == 29
    assert [(r.name, r.sqnr_db, r.rank) for r in two.nodes] == [(r.name, r.sqnr_db, r.rank) for r in one.nodes]


def test_no_ray_cluster_at_the_address_is_one_sentence_with_exit_2(tmp_path):
    """``--ray auto`` with no cluster running (this process's local Ray is shut down first)."""
    from click.testing import CliRunner

    from fp8onnx.pipeline.distributed import close_all

    close_all()
    ray.shutdown()
    try:
        path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
        args = ["calibrate", str(path), "--calib", str(data), "-o", str(tmp_path / "s.json"), "--ray", "auto"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        assert "Could not start or reach the Ray cluster at 'auto'" in result.output
        assert not (tmp_path / "s.json").exists()
    finally:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


def test_models_travel_by_value_where_workers_share_no_files(tmp_path):
    """As on a cluster (the pool marked not local): models, the FP16 baseline and an external-data
    model's weights go through the object store, not as paths; the numbers do not change."""
    from fp8onnx.models.build_llama import build, write_data
    from fp8onnx.pipeline.distributed import close_all, shared_pool

    close_all()
    shared_pool(2, None).local = False
    try:
        model = SAMPLE / "decoder.onnx"
        fp8onnx.quantize(model, tmp_path / "q.onnx", SAMPLE / "calib.npz", provider="cpu")
        one = fp8onnx.compare(model, [tmp_path / "q.onnx"], SAMPLE / "eval.npz", provider="cpu")
        two = fp8onnx.compare(model, [tmp_path / "q.onnx"], SAMPLE / "eval.npz", provider="cpu", workers=2)
        assert _metrics(two) == _metrics(one)
        path = build(tmp_path / "llama", layers=1, dim=64, heads=2, ffn=128, vocab=256)
        write_data(tmp_path / "llama", 256, 16, 24, 8)
        calib = tmp_path / "llama" / "calib.npz"
        for extra in ({}, {"weight_memory": 64 << 10}):
            a = fp8onnx.calibrate(path, calib, provider="cpu", batch_size=4, **extra)
            b = fp8onnx.calibrate(path, calib, provider="cpu", batch_size=4, workers=2, **extra)
            # exact: one graph (or one split of it), one batch shape, one machine; see above
            assert a.amax == b.amax and all(np.array_equal(a.hist[k].counts, b.hist[k].counts) for k in a.hist)
    finally:
        close_all()
