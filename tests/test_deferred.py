"""sympy deferred (fp8onnx/base/deferred.py): not imported by ``import fp8onnx`` nor by a quantize run, and
imported whole on first use, by onnx_ir's symbolic dimensions or by a user's own imports."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import mlp_data, mlp_model

_SCRIPT = r"""
import json, sys
import fp8onnx
state = {"after import": type(sys.modules.get("sympy")).__name__, "sympy.core": "sympy.core" in sys.modules}
for module in list(sys.modules.values()):  # what a scan of sys.modules reads does not load it
    getattr(module, "__file__", None), getattr(module, "__spec__", None), getattr(module, "__name__", None)
state["after a scan"] = type(sys.modules.get("sympy")).__name__
fp8onnx.quantize(sys.argv[1], sys.argv[2], calib=sys.argv[3])
state["after quantize"] = type(sys.modules.get("sympy")).__name__
state["core after quantize"] = "sympy.core" in sys.modules
import onnx_ir as ir
state["dim sum"] = str(ir.SymbolicDim("batch") * 2 + 1)
state["after use"] = type(sys.modules["sympy"]).__name__
import sympy
from sympy import Max
import sympy.core
state["user sympy"] = str(Max(sympy.Symbol("a"), 3) + 1)
state["same module"] = sys.modules["sympy"] is sympy and sympy.core is sys.modules["sympy.core"]
print(json.dumps(state))
"""


def test_sympy_loaded_on_first_use_only(tmp_path):
    model = mlp_model(tmp_path / "m.onnx")
    data = mlp_data(tmp_path / "d.npz")
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(model), str(tmp_path / "q.onnx"), str(data)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state["after import"] == "_StandIn" and not state["sympy.core"]
    assert state["after a scan"] == "_StandIn"
    assert state["after quantize"] == "_StandIn" and not state["core after quantize"]
    assert state["dim sum"] == "2*batch + 1"
    assert state["after use"] == "module"
    assert state["user sympy"] == "Max(3, a) + 1"
    assert state["same module"] is True


def test_nothing_deferred_once_sympy_is_imported(tmp_path):
    script = "import sympy, sys; import fp8onnx; print(type(sys.modules['sympy']).__name__)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == "module"
