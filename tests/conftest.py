import gc
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _young_heap():
    """Objects alive when a test starts are moved out of the collector's reach (gc.freeze): compare's
    session-memory measurement calls gc.collect, whose cost grows with every object the suite has
    made (torch, onnxruntime, Ray's modules: 2 s a compare late in a run, 0.07 s in a fresh process)."""
    gc.freeze()
    yield


# FP8ONNX_TEST_ORT_THREADS=N: every onnxruntime session of this process that asks for the default
# thread count (0) gets N intra-op threads. .ci/run runs the numerics tests again with 1 (SPEC §11:
# the suite passes with 1 and with 2 threads); Ray's worker processes keep onnxruntime's default.
_THREADS = int(os.environ.get("FP8ONNX_TEST_ORT_THREADS", "0") or 0)
if _THREADS:
    import onnxruntime

    class _Session(onnxruntime.InferenceSession):
        def __init__(self, path_or_bytes, sess_options=None, *args, **kwargs):
            if sess_options is None:
                sess_options = onnxruntime.SessionOptions()
            if sess_options.intra_op_num_threads == 0:
                sess_options.intra_op_num_threads = _THREADS
            super().__init__(path_or_bytes, sess_options, *args, **kwargs)

    onnxruntime.InferenceSession = _Session


def pytest_report_header(config):
    threads = _THREADS or "onnxruntime's default"
    blas = os.environ.get("OPENBLAS_CORETYPE", "native")
    return f"onnxruntime intra-op threads: {threads}; OPENBLAS_CORETYPE: {blas}"
