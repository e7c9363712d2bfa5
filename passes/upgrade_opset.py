"""Upgrade the default-domain opset to the one fp8onnx emits (21), explicitly.

Why 21 and not 19 (where float8 QuantizeLinear first appeared): from opset 21 QuantizeLinear takes
an ``output_dtype`` attribute, so a float8 Q needs no zero-point input. onnxruntime's
ReluQuantRewrite (on at its default optimisation level) deletes a Relu feeding a QuantizeLinear
*with* a zero point, letting negative values through for float8 types; without one it leaves the
Relu alone. Models already at 21 or above are left as they are.

Rewrite cases:
  opset < 21   -> converted with onnxscript's version converter; ``from_version`` records the old one
  opset >= 21  -> unchanged (``modified`` is False)
"""

from __future__ import annotations

import logging

import onnx_ir as ir
import onnxscript.version_converter as version_converter

__all__ = ["UpgradeOpsetPass", "TARGET_OPSET", "default_opset"]

logger = logging.getLogger(__name__)
TARGET_OPSET = 21


def default_opset(model: ir.Model) -> int | None:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx"))


class UpgradeOpsetPass(ir.passes.InPlacePass):
    def __init__(self, target: int = TARGET_OPSET):
        super().__init__()
        self.target = target
        self.from_version: int | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        current = default_opset(model)
        self.from_version = current
        if current is not None and current >= self.target:
            return ir.passes.PassResult(model, modified=False)
        if current is None:
            # A graph of custom-domain ops only: declaring the default domain is all it needs.
            model.opset_imports[""] = self.target
        else:
            version_converter.convert_version(model, self.target)
        logger.info("upgraded default opset %s -> %d", current, self.target)
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        if (default_opset(model) or 0) < self.target:
            raise ir.passes.PostconditionError(f"opset is still below {self.target} after the upgrade")
