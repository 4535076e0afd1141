"""A named registry of swappable implementations (parsers, and other parts chosen by name)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from moetier.errors import ConfigError

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """``{name: implementation}`` with a registering decorator and a lookup that fails in one line."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator: register the decorated class under every one of ``names``."""

        def wrap(item: T) -> T:
            for name in names:
                self[name] = item
            return item

        return wrap

    def lookup(self, name: str) -> T:
        """The implementation registered as ``name``; ``ConfigError`` lists the known names otherwise."""
        if name not in self:
            raise ConfigError(f"unknown {self.kind} {name!r}; known: {sorted(self)}")
        return self[name]
