import gc
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
