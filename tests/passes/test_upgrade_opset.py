import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fp8onnx.passes import TARGET_OPSET, UpgradeOpsetPass, default_opset

from helpers import mlp_model, run_ort


@pytest.mark.parametrize("opset", [13, 17, 19, 20])
def test_upgrades_old_opsets_and_keeps_numbers(tmp_path, opset):
    path = mlp_model(tmp_path / "m.onnx", opset=opset)
    model = ir.load(path)
    p = UpgradeOpsetPass()
    assert p(model).modified
    assert p.from_version == opset
    assert default_opset(model) == TARGET_OPSET
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    for a, b in zip(run_ort(onnx.load(path), {"x": x}), run_ort(proto, {"x": x})):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert not UpgradeOpsetPass()(model).modified  # idempotent


def test_leaves_newer_opsets_alone(tmp_path):
    model = ir.load(mlp_model(tmp_path / "m.onnx", opset=22))
    assert not UpgradeOpsetPass()(model).modified
    assert default_opset(model) == 22
