"""Wrappers that forward exactly what the backend behind them implements.

A capability is a method (tangram.protocol: ``Moving.move``, ``Evicting.evict``, ...): a
wrapper that defined every optional method and called its inner backend's would claim,
through ``isinstance``, what the inner one cannot do. A wrapper forwards them with
:func:`optional` from its ``__getattr__`` instead: the attribute exists exactly when the
inner backend has it.
"""

from __future__ import annotations

from typing import Any

from tangram.protocol import METHOD_CAPABILITIES

#: every optional method of a backend (the methods of tangram.protocol's capability
#: protocols), by name
OPTIONAL_METHODS: frozenset[str] = frozenset(
    name for proto in METHOD_CAPABILITIES.values() for name in vars(proto)
    if not name.startswith("_"))


def optional(name: str, *inners: Any) -> Any:
    """The optional method ``name`` of the first of ``inners`` that has it (None entries
    skipped); AttributeError (as a missing attribute raises) when none has, or when
    ``name`` is not an optional method."""
    if name in OPTIONAL_METHODS:
        for inner in inners:
            if inner is not None and hasattr(inner, name):
                return getattr(inner, name)
    raise AttributeError(name)
