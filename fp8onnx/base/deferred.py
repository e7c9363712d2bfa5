"""sympy imported when first used, not when onnx_ir is imported (done when this module is imported,
which ``fp8onnx/__init__.py`` does before anything else).

onnx_ir imports sympy (and builds a table of sympy functions in ``onnx_ir._symbolic_shapes``) for
arithmetic on symbolic dimensions, which fp8onnx never does: 0.22 s of the 0.5 s that ``import
fp8onnx`` takes on the 2-core development machine, at every command. :func:`defer` puts stand-ins for
both modules in ``sys.modules`` before onnx_ir is imported; the first attribute read from either (a
``sympy.Expr`` in an ``isinstance``, a ``SymbolicDim`` sum, a user's own ``import sympy.core`` or
``from sympy import Symbol``) imports the real module, puts it in ``sys.modules`` and answers from it.

``importlib.util.LazyLoader`` cannot do this on Python 3.11: the import statement reads
``__spec__`` of a module it finds in ``sys.modules``, which loads a lazy module at once. A stand-in
carries the real ``__spec__`` and ``__file__`` (so ``import sympy`` elsewhere, or a scan of
``sys.modules``, finds it untouched) and forwards every other attribute.

requires: neither module imported yet, both findable (else nothing is done);
ensures: the real module is imported exactly once, on first use, and every later ``import`` of it
returns the real module.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types

__all__ = ["defer"]

_LOCK = threading.RLock()


class _StandIn(types.ModuleType):
    """A module that imports the real one named like it on the first attribute it does not have."""

    def _real(self) -> types.ModuleType:
        with _LOCK:
            real = self.__dict__.get("_deferred_real")
            if real is None:
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]
                real = importlib.import_module(self.__name__)
                self.__dict__["_deferred_real"] = real
            return real

    def __getattr__(self, attr: str):  # only for attributes the stand-in lacks: all but its spec and name
        if attr == "_deferred_real":
            raise AttributeError(attr)
        return getattr(self._real(), attr)

    def __dir__(self):
        return dir(self._real())


def _stand_in(name: str, spec: importlib.machinery.ModuleSpec | None) -> None:
    if spec is None or spec.loader is None:
        return
    module = _StandIn(name)
    module.__spec__, module.__loader__, module.__package__ = spec, spec.loader, spec.parent
    # what scans of sys.modules read (inspect.getmodule, tracebacks): answered without loading the module,
    # which would add modules to sys.modules under a scan that iterates it
    module.__file__ = spec.origin
    sys.modules[name] = module


def defer() -> None:
    """Stand-ins for ``sympy`` and ``onnx_ir._symbolic_shapes`` (see the module's docstring); nothing
    where either is imported already or cannot be found."""
    with _LOCK:
        if any(n in sys.modules for n in ("sympy", "onnx_ir", "onnx_ir._symbolic_shapes")):
            return
        try:
            sympy_spec = importlib.util.find_spec("sympy")
            ir_spec = importlib.util.find_spec("onnx_ir")  # a top-level package: found, not imported
        except (ImportError, ValueError):
            return
        if sympy_spec is None or ir_spec is None or not ir_spec.submodule_search_locations:
            return
        shapes_spec = importlib.machinery.PathFinder.find_spec(
            "onnx_ir._symbolic_shapes", list(ir_spec.submodule_search_locations)
        )
        if shapes_spec is None:
            return
        _stand_in("sympy", sympy_spec)
        _stand_in("onnx_ir._symbolic_shapes", shapes_spec)


defer()
