"""The bundled calibration text: CPython's documentation, and for a model too wide for it, CPython's own
standard library code until the tokenizer counts the tokens GPTQ wants (16 rows a channel of the widest
input)."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fp8onnx.data.text import load_tokenizer
from fp8onnx.data.text_sample import python_text_sample
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.workflows.calibration_data import tokens_wanted


@pytest.fixture
def tokenizer(tmp_path):
    """A word-level tokenizer over whitespace: one token a word (unknown words one [UNK] each)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "def": 2}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def _count(tokenizer, source) -> int:
    return len(load_tokenizer(tokenizer).encode(open(source, encoding="utf-8").read()).ids)


def test_documentation_and_as_much_code(tokenizer):
    """requires: a tokenizer. ensures: about 136 kB of documentation, then standard library code until the
    tokenizer counts as many tokens of code, named so; a count the two meet changes nothing."""
    sample = python_text_sample(tokenizer)
    text = open(sample, encoding="utf-8").read()
    assert "standard library code" in str(sample) and "\ndef " in text
    docs = len(load_tokenizer(tokenizer).encode(text[: text.index('"""')]).ids)  # up to the first module
    assert _count(tokenizer, sample) >= 2 * docs * 0.95
    same = python_text_sample(tokenizer, _count(tokenizer, sample) // 2)
    assert open(same, encoding="utf-8").read() == text


def test_a_wide_models_count_adds_more_code(tokenizer):
    """requires: a count above the default sample's. ensures: more code, until the tokenizer counts it."""
    base = _count(tokenizer, python_text_sample(tokenizer))
    grown = python_text_sample(tokenizer, 2 * base)
    assert _count(tokenizer, grown) >= 2 * base


def test_more_than_python_ships_is_one_warning(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="fp8onnx"):
        python_text_sample(tokenizer, 10**9)
    assert any("pass --calib DATA with more text" in r.getMessage() for r in caplog.records)


def test_the_tokens_wanted_are_gptqs_rows_for_the_widest_input(tmp_path):
    """16 rows a channel of the widest constant weight's K (a MatMul [K, N], a transposed Gemm [N, K]);
    none with round-to-nearest."""
    import onnx_ir as ir

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 96)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 96)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Gemm", ["h", "w2"], ["y"], transB=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 8])],
        [w1, w2],
    )
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    onnx.checker.check_model(ir.serde.serialize_model(model))
    assert tokens_wanted(model, QuantizeConfig(weight_rounding="gptq")) == 16 * 96
    assert tokens_wanted(model, QuantizeConfig()) == 0
