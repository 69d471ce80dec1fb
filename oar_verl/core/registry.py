"""Named registries, the way verl keeps its advantage estimators and engines: an attribution method is looked up by
``algorithm.oar.mode``, a perturbation policy by ``algorithm.oar.perturbation``, a mask operator by
``algorithm.oar.mask``, a backend by the runtime that runs it; never picked by a chain of ``if`` tests. An entry
carries the facts the layers around it need (a method's traits, an operator's), so the registry is their one source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """``name -> entry``; looking up an unknown name raises a ValueError naming the key and the registered names.

    Args:
        what: what the entries are (for errors), e.g. "attribution method".
        key: the setting that names an entry (for errors), e.g. "algorithm.oar.mode".
    """

    def __init__(self, what: str, key: str):
        self.what, self.key = what, key
        self._entries: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under every one of ``names``. A name registered twice by
        different code is an error (two plug-ins must not silently replace each other); the same definition again
        (a module reloaded) replaces itself."""

        def add(entry: T) -> T:
            for name in names:
                old = self._entries.get(name)
                if old is not None and _origin(old) != _origin(entry):
                    raise ValueError(f"{self.what} {name!r} is already registered by {_origin(old)}")
                self._entries[name] = entry
            return entry

        return add

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return its entry (a plug-in withdrawn, a test's temporary entry)."""
        self.get(name)
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"{self.key}={name!r} is not a registered {self.what}; registered: "
                             f"{', '.join(sorted(self._entries))}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        """The registered names, in the order they were registered (the order errors and docs list them in)."""
        return tuple(self._entries)


def _origin(entry) -> str:
    """Where an entry was defined: module and qualified name (of its ``run`` function, or its class, for an
    instance)."""
    owner = entry if hasattr(entry, "__qualname__") else getattr(entry, "run", type(entry))
    return f"{owner.__module__}.{owner.__qualname__}"
