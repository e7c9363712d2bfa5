"""FP8 training (emulated): the casts agree with fp8onnx's ONNX numerics bit for bit, scales follow
the recipes through fp8onnx.numerics.scaling, gradients stay within the formats' bounds of a float reference,
the swap touches only nn.Linear, and a small model still learns."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fp8onnx.base.errors import Fp8OnnxError  # noqa: E402
from fp8onnx.experiments.training import FP8Linear, Recipe, fake_cast, swap_linear  # noqa: E402
from fp8onnx.numerics.formats import Fp8Format, dequantize, quantize  # noqa: E402
from fp8onnx.numerics.scaling import Scaling, amax_to_scale  # noqa: E402


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3FN, Fp8Format.E5M2])
def test_the_cast_is_onnx_quantize_then_dequantize_bit_for_bit(fmt):
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(4000) * 10.0 ** rng.uniform(-8, 3, 4000),  # subnormals to saturation
            np.array([0.0, -0.0, fmt.fmax * 3, -fmt.fmax * 3]),
        ]
    ).astype(np.float32)
    scale = np.float32(0.37)
    expected = dequantize(quantize(x, scale, fmt), scale, np.float32)
    got = fake_cast(torch.from_numpy(x), float(scale), fmt).numpy()
    np.testing.assert_array_equal(got, expected)


def _linear(rng, n=64, k=48, m=32):
    x = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
    lin = torch.nn.Linear(k, m)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32) / math.sqrt(k)))
    return x, lin


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_gradients_are_within_the_formats_bounds_of_float():
    rng = np.random.default_rng(1)
    x, ref = _linear(rng)
    fp8 = FP8Linear.from_linear(torch.nn.Linear(48, 32), Recipe("amax", pow2=False))
    fp8.weight = torch.nn.Parameter(ref.weight.detach().clone())
    fp8.bias = torch.nn.Parameter(ref.bias.detach().clone())
    g = torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float32))
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ref(xr) * g).sum().backward()
    (fp8(xf) * g).sum().backward()
    # one E4M3 rounding: relative RMS error 2**-3 / sqrt(12) = 3.6%; E5M2: 2**-2 / sqrt(12) = 7.2%
    e4m3, e5m2 = 2**-3 / math.sqrt(12), 2**-2 / math.sqrt(12)
    assert _rel(fp8(x).detach(), ref(x).detach()) < 2 * math.sqrt(2) * e4m3  # two operands rounded
    assert _rel(xf.grad, xr.grad) < 2 * math.hypot(e5m2, e4m3)
    assert _rel(fp8.weight.grad, ref.weight.grad) < 2 * math.hypot(e5m2, e4m3)
    torch.testing.assert_close(fp8.bias.grad, ref.bias.grad)  # the bias gradient stays float32
    assert _rel(xf.grad, xr.grad) > 1e-4  # it really went through FP8


def test_amax_scales_follow_the_recipe_through_fp8onnx_scaling():
    rng = np.random.default_rng(2)
    x, lin = _linear(rng)
    layer = FP8Linear.from_linear(lin, Recipe("amax", margin=1, history=3))
    amaxes = []
    for step in range(5):
        xs = x * (2.0**step)
        amaxes.append(float(xs.abs().max()))
        layer(xs).sum().backward()
        expected = amax_to_scale(max(amaxes[-3:]), Fp8Format.E4M3FN, Scaling.POW2, margin=1)
        assert layer.last_scales()["input"] == expected
        assert math.log2(expected).is_integer()
    weight_scale = amax_to_scale(float(lin.weight.detach().abs().max()), Fp8Format.E4M3FN, Scaling.POW2, margin=1)
    assert layer.last_scales()["weight"] == weight_scale
    grad = layer.scales["grad"]
    assert len(grad.biases) == 5 and grad.fmt is Fp8Format.E5M2
    assert layer.scales["input"].biases == [-math.log2(s) for s in [2.0**-b for b in layer.scales["input"].biases]]


def test_cscale_keeps_its_constants_and_saturates_outside_them():
    rng = np.random.default_rng(3)
    x, lin = _linear(rng)
    layer = FP8Linear.from_linear(lin, Recipe("cscale", scale=2.0**-12, grad_scale=2.0**-20))
    y = layer(x)
    assert layer.last_scales()["input"] == 2.0**-12 and layer.last_scales()["weight"] == 2.0**-12
    # 448 * 2**-12 = 0.11: every larger input and weight saturates
    assert float(fake_cast(x, 2.0**-12, Fp8Format.E4M3FN).abs().max()) == pytest.approx(448 * 2.0**-12)
    y.sum().backward()
    assert layer.last_scales()["grad"] == 2.0**-20
    with pytest.raises(Fp8OnnxError, match="Unknown FP8 training recipe"):
        Recipe("fixed")
    with pytest.raises(Fp8OnnxError, match="loss_scale must be positive"):
        Recipe("cscale", loss_scale=0.0)


def test_swap_replaces_only_linear_layers_and_keeps_their_parameters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8),
        torch.nn.Linear(8, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()),
        torch.nn.Conv1d(4, 4, 1),
        torch.nn.Linear(16, 3),
    )
    weights = {name: p for name, p in model.named_parameters()}
    kinds = {name: type(m) for name, m in model.named_modules()}
    replaced = swap_linear(model, Recipe(), skip=lambda name, _: name == "5")
    assert replaced == ["1", "3.0"]
    assert isinstance(model[1], FP8Linear) and isinstance(model[3][0], FP8Linear) and type(model[5]) is torch.nn.Linear
    for name, m in model.named_modules():
        if name not in ("1", "3.0"):
            assert type(m) is kinds[name], name
    assert all(p is weights[name] for name, p in model.named_parameters())  # the same Parameter objects
    assert swap_linear(model, Recipe(), skip=lambda name, _: name == "5") == []  # FP8Linear is not swapped again


@pytest.mark.parametrize("recipe", [Recipe("amax"), Recipe("amax", history=4, margin=1)])
def test_a_small_model_learns_as_well_in_fp8_amax(recipe):
    def run(fp8: bool) -> float:
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        x = torch.from_numpy(rng.standard_normal((512, 16)).astype(np.float32))
        y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
        if fp8:
            swap_linear(model, recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(150):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return float((model(x).argmax(1) == y).float().mean())

    float_acc, fp8_acc = run(False), run(True)
    assert float_acc > 0.9 and fp8_acc >= 0.98 * float_acc


class _Block(torch.nn.Module):
    """A transformer-style block: 3-D activations (MatMul after export) and a 2-D head (Gemm)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return self.head(h.mean(1))


@pytest.mark.parametrize(
    "recipe", [Recipe("amax", history=2), Recipe("amax", pow2=False), Recipe("cscale", scale=2**-6)]
)
def test_trained_scales_deploy_to_onnx_and_match_the_torch_forward(tmp_path, recipe):
    import onnx
    import onnxruntime as ort

    from fp8onnx.experiments.training import export

    torch.manual_seed(0)
    model = _Block()
    swap_linear(model, recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(8, 5, 16)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    model.eval()
    deployed = export(
        model, (x,), tmp_path / "m.onnx", input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}}
    )
    assert sorted(deployed) == ["down", "head", "up"]
    proto = onnx.load(tmp_path / "m.onnx")
    q = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    float8 = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN]
    assert len(q) == 3 and len(float8) == 3  # each layer's input quantized in the graph, its weight stored as E4M3
    for layer in (model.up, model.down, model.head):
        assert layer.freeze() == deployed[{model.up: "up", model.down: "down", model.head: "head"}[layer]]
    with torch.no_grad():
        expected = model(x).numpy()
    so = ort.SessionOptions()
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()}
    )[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)  # the same FP8 numbers; only sums reorder
    with pytest.raises(Fp8OnnxError, match="no FP8Linear layer"):
        export(torch.nn.Sequential(torch.nn.Linear(2, 2)), (torch.zeros(1, 2),), tmp_path / "n.onnx")
