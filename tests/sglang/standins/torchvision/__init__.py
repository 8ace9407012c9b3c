"""Import-only stand-in for ``torchvision``, for the SGLang tests' interpreter only.

Stands in for: PyPI's torchvision, which is built against CUDA torch and fails to load next to the CPU
torch the SGLang test venv uses ("operator torchvision::nms does not exist"). SGLang imports
``torchvision.transforms`` at import time for its multimodal processors, which a text-only tiny model
never runs. Every name resolves (also in submodules, ``torchvision.transforms.v2.functional`` ...);
using one raises, naming this stand-in, so a test that does need torchvision fails loudly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Unavailable:
    """Any attribute of the stand-in: attribute access goes on, use raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is a test stand-in here (tests/sglang/standins)")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())
__version__ = "0.0.0+ucm-test-standin"
__path__: list[str] = []


def __getattr__(attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Unavailable(f"torchvision.{attr}")
