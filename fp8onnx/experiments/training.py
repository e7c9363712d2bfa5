"""FP8 training, emulated on the CPU with torch's float8 dtypes: the training half of the FP8 LLM paper.

:class:`FP8Linear` is a drop-in ``torch.nn.Linear`` whose matmuls run on FP8-cast operands:

* forward: input and weight cast to E4M3 with per-tensor scales, ``y = x_q @ w_q^T + b``;
* backward: the output gradient cast to E5M2 with its own scale, ``dx = g_q @ w_q`` and
  ``dw = g_q^T @ x_q``; the bias gradient and everything after stay in float32.

The weight itself (the master copy) and the optimizer state stay float32; only the copies the
matmuls read are FP8. A cast is ``q = saturate(x / scale)`` rounded to the nearest FP8 value, read
back as ``q * scale``: the ONNX QuantizeLinear convention (a scale is a divisor), so trained scales
deploy as they are. Scales come from :func:`fp8onnx.numerics.scaling.amax_to_scale`, the one place that turns
an amax into a scale:

* recipe ``amax`` (FP8-AMAX): each tensor's scale from the largest amax of its last ``history``
  steps (1: the current tensor), with the paper's exponent-bias rule ``b = floor(log2(fmax /
  amax)) - margin``, ``scale = 2**-b`` (``pow2=True``), or ``amax / fmax``;
* recipe ``cscale`` (FP8-CSCALE): one constant scale for inputs and weights and one for gradients,
  with loss scaling (:attr:`Recipe.loss_scale`) to keep small gradients out of E5M2's underflow.

Every layer records its scale biases (``-log2(scale)``) per step for the study's histograms.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import pathlib
from collections.abc import Callable

import numpy as np
import torch

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.scratch import temporary_dir
from fp8onnx.graph.model_io import save_model
from fp8onnx.graph.plan import plan
from fp8onnx.graph.prepare import prepare_model
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.numerics.scaling import Scaling, amax_to_scale
from fp8onnx.passes import InsertQDQPass, ShieldBiasPass, TensorQuant
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.techniques.scales import bias_overflows

__all__ = ["FP8Linear", "Recipe", "deployed_scales", "export", "fake_cast", "swap_linear"]

FORWARD, BACKWARD = Fp8Format.E4M3FN, Fp8Format.E5M2
_TORCH = {Fp8Format.E4M3FN: torch.float8_e4m3fn, Fp8Format.E5M2: torch.float8_e5m2}
KINDS = ("input", "weight", "grad")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How an FP8 layer picks its scales (see the module docstring)."""

    kind: str = "amax"  # amax | cscale
    margin: int = 0  # amax: exponent-bias margin (each step of margin halves the headroom used)
    history: int = 1  # amax: steps of amax history the scale is taken from (1: the current tensor)
    pow2: bool = True  # amax: power-of-two scales (the paper's exponent bias); False: amax / fmax
    scale: float = 1.0  # cscale: the scale of inputs and weights
    grad_scale: float = 1.0  # cscale: the scale of output gradients
    loss_scale: float = 1.0  # multiply the loss by this before backward, divide the gradients after

    def __post_init__(self):
        if self.kind not in ("amax", "cscale"):
            raise Fp8OnnxError(f"Unknown FP8 training recipe {self.kind!r}; choose amax or cscale.")
        if self.history < 1:
            raise Fp8OnnxError(f"The amax history must be at least 1 step, got {self.history}.")
        for name in ("scale", "grad_scale", "loss_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise Fp8OnnxError(f"Recipe {name} must be positive and finite, got {value!r}.")


def fake_cast(x: torch.Tensor, scale: float, fmt: Fp8Format) -> torch.Tensor:
    """``x`` through ``fmt`` at ``scale``: saturate(x / scale) rounded to the nearest FP8 value (ties
    to even), times ``scale``, in x's dtype. The same numbers as ONNX QuantizeLinear (saturate=1)
    followed by DequantizeLinear."""
    fmax = fmt.fmax
    q = (x.float() / scale).clamp(-fmax, fmax).to(_TORCH[fmt])
    return (q.float() * scale).to(x.dtype)


class _Scales:
    """One tensor's scale state: the amax history, the scale in use and the biases it had."""

    def __init__(self, fmt: Fp8Format, recipe: Recipe, constant: float):
        self.fmt, self.recipe, self.constant = fmt, recipe, constant
        self.history: collections.deque[float] = collections.deque(maxlen=recipe.history)
        self.biases: list[float] = []  # -log2(scale) at each step
        self.amaxes: list[float] = []

    def scale_for(self, x: torch.Tensor) -> float:
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        self.amaxes.append(amax)
        if self.recipe.kind == "cscale":
            scale = self.constant
        else:
            self.history.append(amax)
            method = Scaling.POW2 if self.recipe.pow2 else Scaling.AMAX
            scale = amax_to_scale(max(self.history), self.fmt, method, margin=self.recipe.margin)
        self.biases.append(-math.log2(scale))
        return scale


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        xq = fake_cast(x, layer.scale("input", x), FORWARD)
        wq = fake_cast(weight, layer.scale("weight", weight), FORWARD)
        ctx.save_for_backward(xq, wq)
        ctx.layer, ctx.has_bias = layer, bias is not None
        y = xq @ wq.t()
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        xq, wq = ctx.saved_tensors
        gq = fake_cast(grad, ctx.layer.scale("grad", grad), BACKWARD)
        gx = gq @ wq
        gw = gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return gx, gw, gb, None


class FP8Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with FP8 matmuls (see the module docstring); same parameters and state."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Recipe | None = None):
        super().__init__(in_features, out_features, bias)
        self.recipe = recipe or Recipe()
        self.scales = {
            "input": _Scales(FORWARD, self.recipe, self.recipe.scale),
            "weight": _Scales(FORWARD, self.recipe, self.recipe.scale),
            "grad": _Scales(BACKWARD, self.recipe, self.recipe.grad_scale),
        }
        self.frozen: dict[str, float] | None = None  # fixed input/weight scales (freeze, export)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Recipe | None = None) -> FP8Linear:
        """An FP8Linear that shares ``linear``'s parameter objects (an optimizer built on them keeps
        working)."""
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe)
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.train(linear.training)
        return layer

    def scale(self, kind: str, x: torch.Tensor) -> float:
        """The scale of ``x`` (input, weight or grad) for this step: from the recipe, or the frozen one."""
        if self.frozen is not None and kind in self.frozen:
            return self.frozen[kind]
        return self.scales[kind].scale_for(x)

    def freeze(self) -> dict[str, float]:
        """Fix the input and weight scales at what a deployed model uses (see :func:`export`); later
        forwards no longer update them, so the torch model computes what the exported ONNX model does."""
        self.frozen = deployed_scales(self)
        return self.frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8Matmul.apply(x, self.weight, self.bias, self)

    def last_scales(self) -> dict[str, float]:
        """The scale each of input, weight and grad had at its last step (2**-bias)."""
        return {k: 2.0 ** -s.biases[-1] for k, s in self.scales.items() if s.biases}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.kind}"


def swap_linear(
    module: torch.nn.Module, recipe: Recipe | None = None, skip: Callable[[str, torch.nn.Linear], bool] | None = None
) -> list[str]:
    """Replace every ``torch.nn.Linear`` under ``module`` (not subclasses such as FP8Linear itself)
    by an :class:`FP8Linear` sharing its parameters, except where ``skip(name, layer)`` is true.
    Every other module is left as it is. Returns the qualified names replaced."""
    replaced = []
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            full = f"{name}.{attr}" if name else attr
            if type(sub) is torch.nn.Linear and not (skip and skip(full, sub)):
                setattr(child, attr, FP8Linear.from_linear(sub, recipe))
                replaced.append(full)
    return replaced


def _frozen_scale(scales: _Scales) -> float:
    """The scale a deployed model uses for this tensor: the recipe's constant, or the amax scale of
    the largest amax the layer's history holds (what the last training step used)."""
    if scales.recipe.kind == "cscale":
        return scales.constant
    if not scales.history:
        raise Fp8OnnxError("An FP8Linear that never ran has no trained scale to deploy; train (or run) it first.")
    method = Scaling.POW2 if scales.recipe.pow2 else Scaling.AMAX
    return amax_to_scale(max(scales.history), scales.fmt, method, margin=scales.recipe.margin)


def deployed_scales(layer: FP8Linear) -> dict[str, float]:
    """The input and weight scales a deployed ``layer`` uses: the input's from its amax history (the
    largest amax it holds, as the last training step used) or the cscale constant; the weight's from
    the weight as it is now (the optimizer moved it after its last cast)."""
    recipe = layer.recipe
    if recipe.kind == "cscale":
        return {"input": recipe.scale, "weight": recipe.scale}
    method = Scaling.POW2 if recipe.pow2 else Scaling.AMAX
    return {
        "input": _frozen_scale(layer.scales["input"]),
        "weight": amax_to_scale(float(layer.weight.detach().abs().max()), FORWARD, method, margin=recipe.margin),
    }


def export(
    model: torch.nn.Module,
    example_inputs: tuple,
    path,
    *,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    dynamic_axes: dict | None = None,
) -> dict[str, dict[str, float]]:
    """Write ``model`` as ONNX with every :class:`FP8Linear`'s matmul reading float8 Q/DQ of its input
    and weight at the scales training left it with (not re-calibrated): the input's from its amax
    history (or the cscale constant), the weight's from the weight itself. The graph is exported from
    a float copy (torch's TorchScript exporter), prepared as ``fp8onnx quantize`` prepares models
    (opset 21, weight transforms folded), and each layer's MatMul/Gemm found by its weight's values.
    Returns the deployed scales per layer name. Everything else stays in float."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    if not layers:
        raise Fp8OnnxError("The model has no FP8Linear layer to deploy (swap_linear first).")
    deployed = {name: deployed_scales(m) for name, m in layers.items()}
    plain = _float_copy(model)
    weights = {name: m.weight.detach().float().numpy() for name, m in layers.items()}
    with temporary_dir("fp8onnx-train-") as tmp:
        raw = pathlib.Path(tmp) / "float.onnx"
        plain.eval()
        with torch.no_grad():
            torch.onnx.export(
                plain,
                example_inputs,
                str(raw),
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=17,
                dynamo=False,
            )
        ir_model, _, _ = prepare_model(raw)
    decisions, _ = plan(ir_model, QuantizeConfig())
    chosen, quant, found = _by_weight(decisions, weights, deployed)
    missing = sorted(set(layers) - found)
    if missing:
        raise Fp8OnnxError(f"FP8Linear layers {', '.join(missing)} have no MatMul/Gemm in the exported graph.")
    shielded = bias_overflows(chosen, quant)
    if shielded:
        ShieldBiasPass(shielded)(ir_model)
    InsertQDQPass([(d.node, i) for d in chosen for i, _ in d.inputs], quant)(ir_model)
    ir_model.metadata_props["fp8onnx_training"] = "scales from FP8 training: " + ", ".join(
        f"{name}: input {s['input']:g}, weight {s['weight']:g}" for name, s in deployed.items()
    )
    save_model(ir_model, path)
    return deployed


def _float_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every FP8Linear a plain torch.nn.Linear sharing its parameters."""
    plain = copy.deepcopy(model)
    for module in list(plain.modules()):
        for attr, sub in list(module.named_children()):
            if isinstance(sub, FP8Linear):
                linear = torch.nn.Linear(sub.in_features, sub.out_features, sub.bias is not None, device="meta")
                linear.weight, linear.bias = sub.weight, sub.bias
                setattr(module, attr, linear)
    return plain


def _by_weight(decisions, weights: dict, deployed: dict):
    """(the decisions of the FP8Linear layers' MatMul/Gemm, their inputs' TensorQuant at the deployed
    scales, the layer names found): each node told by its weight's values."""
    chosen, quant, found = [], {}, set()
    for d in decisions:
        node = d.node
        w = node.inputs[1].const_value.numpy() if d.inputs and node.inputs[1].const_value is not None else None
        if w is None:
            continue
        transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
        for name, weight in weights.items():
            if w.shape == (weight.shape if transposed else weight.T.shape) and np.array_equal(
                w, weight if transposed else weight.T
            ):
                chosen.append(d)
                quant[node.inputs[0].name] = TensorQuant(FORWARD, deployed[name]["input"])
                quant[node.inputs[1].name] = TensorQuant(FORWARD, deployed[name]["weight"])
                found.add(name)
                break
    return chosen, quant, found
