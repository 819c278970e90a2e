"""Extension points: a name -> factory registry, extended by Python entry points.

Built-ins register themselves; users add their own environments/verifiers/backends by
declaring an entry point in their package (group ``rlbus.environments`` etc.) — no fork needed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownExtension(LookupError):
    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, known
        super().__init__(
            f"unknown {kind} {name!r}; registered: {', '.join(known) or 'none'}. "
            f"Register one with an entry point in group 'rlbus.{kind}s'."
        )


class Registry(Generic[T]):
    def __init__(self, kind: str, *, lazy: dict[str, str] | None = None) -> None:
        """``lazy`` maps built-in names to ``"module:attr"`` imported only when chosen, so a
        torch-only machine never imports vLLM."""
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self._lazy = dict(lazy or {})
        self._loaded_entry_points = False

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            self._factories[name] = factory
            return factory

        return deco

    def _load_entry_points(self) -> None:
        if self._loaded_entry_points:
            return
        self._loaded_entry_points = True
        for ep in entry_points(group=f"rlbus.{self.kind}s"):
            if ep.name not in self._factories:
                self._factories[ep.name] = ep.load()

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted({*self._factories, *self._lazy})

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._factories and name in self._lazy:
            module, attr = self._lazy[name].split(":")
            self._factories[name] = getattr(importlib.import_module(module), attr)
        if name not in self._factories:
            self._load_entry_points()
        try:
            return self._factories[name]
        except KeyError:
            raise UnknownExtension(self.kind, name, self.names()) from None

    def create(self, name: str, **config: object) -> T:
        return self.get(name)(**config)
