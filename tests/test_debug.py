"""--debug shows the error behind fp8onnx's sentence (raised ``from`` it), which stays one line without it;
the package tells type checkers it is typed (py.typed)."""

import importlib.resources

from click.testing import CliRunner

from fp8onnx.cli import main


def test_debug_shows_the_cause_and_the_plain_run_one_sentence(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    plain = CliRunner().invoke(main, ["inspect", str(bad)])
    assert plain.exit_code == 2 and "Traceback" not in plain.output
    assert plain.output.strip().splitlines()[-1].startswith("fp8onnx: error: Model file")
    debug = CliRunner().invoke(main, ["--debug", "inspect", str(bad)])
    assert debug.exit_code == 2
    assert "DecodeError" in debug.output and "The above exception was the direct cause" in debug.output
    assert debug.output.strip().splitlines()[-1] == plain.output.strip().splitlines()[-1]


def test_the_package_is_marked_typed():
    assert (importlib.resources.files("fp8onnx") / "py.typed").is_file()
