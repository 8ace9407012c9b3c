"""``UcmSparseFactory``: the one place that maps a method name to its class.

Registration stores a module path and class name only; the module is imported when an instance is
first created, so listing methods never imports torch-heavy code (vLLM's connector and attention
backend registries work the same way). Duplicates are rejected rather than silently replaced, and an
unknown name is answered with the list of known ones. Out-of-tree methods come in two ways: a
``module_path`` / ``class_name`` pair in ``ucm_sparse_config``, or a Python entry point in the group
``ucm.sparse_methods`` (name = method name, value = ``"pkg.module:Class"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, ClassVar

from ucm_client.sparse.base import UcmSparseBase, UcmSparseRole
from ucm_client.sparse.config import UcmSparseConfig
from ucm_client.sparse.errors import SparseConfigError, UnknownSparseMethodError
from ucm_client.sparse.seed_form import SeedFormAdapter, is_seed_form

__all__ = ["ENTRY_POINT_GROUP", "UcmSparseFactory"]

ENTRY_POINT_GROUP = "ucm.sparse_methods"


class UcmSparseFactory:
    """Registry of sparse methods by name."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def register_sparse_method(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``name``; registering a different target under a taken name is an error."""
        target = (module_path, class_name)
        existing = cls._registry.get(name)
        if existing is not None and existing != target:
            raise SparseConfigError(
                f"sparse method {name!r} is already registered as {existing[0]}.{existing[1]}"
            )
        cls._registry[name] = target

    @classmethod
    def known_methods(cls) -> list[str]:
        """Registered names plus those offered by installed entry points."""
        names = set(cls._registry)
        names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
        return sorted(names)

    @classmethod
    def _resolve(cls, name: str) -> tuple[str, str]:
        if name in cls._registry:
            return cls._registry[name]
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == name:
                module_path, _, class_name = ep.value.partition(":")
                if not class_name:
                    raise SparseConfigError(f"entry point {name!r} must be 'module:Class', got {ep.value!r}")
                cls.register_sparse_method(name, module_path, class_name)
                return module_path, class_name
        raise UnknownSparseMethodError(f"unknown sparse method {name!r}; known: {cls.known_methods()}")

    @classmethod
    def load_class(cls, name: str) -> type[UcmSparseBase]:
        """Import and return the class registered as ``name``."""
        module_path, class_name = cls._resolve(name)
        try:
            module = importlib.import_module(module_path)
            sparse_cls = getattr(module, class_name)
        except (ImportError, AttributeError) as exc:
            raise SparseConfigError(
                f"sparse method {name!r}: cannot load {module_path}.{class_name}: {exc}"
            ) from exc
        if not (
            isinstance(sparse_cls, type)
            and (issubclass(sparse_cls, UcmSparseBase) or is_seed_form(sparse_cls))
        ):
            raise SparseConfigError(
                f"sparse method {name!r}: {module_path}.{class_name} is not a UcmSparseBase "
                "(nor a class with all of the upstream example's public hooks)"
            )
        return sparse_cls

    @classmethod
    def create_sparse_method(
        cls, name: str, role: UcmSparseRole, config: Mapping[str, Any], *, min_seq_len: int = 0
    ) -> UcmSparseBase:
        """Instantiate ``name`` for ``role`` with its own config section.

        A class written in upstream UCM's example form is built as upstream builds it (``cls(role, config)``)
        and run inside :class:`SeedFormAdapter`, so the session checks apply to it too.
        """
        sparse_cls = cls.load_class(name)
        if is_seed_form(sparse_cls):
            inner = sparse_cls(role, dict(config))
            return SeedFormAdapter(role, config, inner=inner, min_seq_len=min_seq_len)
        return sparse_cls(role, config, min_seq_len=min_seq_len)

    @classmethod
    def from_config(cls, config: UcmSparseConfig, role: UcmSparseRole) -> UcmSparseBase:
        """Instantiate the method a parsed ``ucm_sparse_config`` selects (module path first)."""
        if config.module_path is not None and config.class_name is not None:
            cls.register_sparse_method(config.algorithm, config.module_path, config.class_name)
        return cls.create_sparse_method(
            config.algorithm, role, config.method_config, min_seq_len=config.min_seq_len
        )


for _name, _module, _cls in (
    ("ESA", "ucm_client.sparse.methods.esa", "ESA"),
    ("GSA", "ucm_client.sparse.methods.gsa", "GSA"),
    ("GSAOnDevice", "ucm_client.sparse.methods.gsa", "GSAOnDevice"),
    ("KVStarMultiStep", "ucm_client.sparse.methods.kvstar", "KVStarMultiStep"),
    ("Blend", "ucm_client.sparse.methods.blend", "Blend"),
    ("ReRoPE", "ucm_client.sparse.methods.rerope", "ReRoPE"),
):
    UcmSparseFactory.register_sparse_method(_name, _module, _cls)
