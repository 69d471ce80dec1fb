"""Attributes set for the duration of a block and restored exactly: whatever the instance (or module) held before is
what it holds after, on error too. An attribute another library bound on the instance (Liger's kernels bind their
``forward`` on the module instances verl patches) is put back, never deleted; one that was not there is removed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_ABSENT = object()


@contextlib.contextmanager
def patched_attributes(owner, **values) -> Iterator[None]:
    """Set ``owner.name = value`` for every keyword for the duration, then restore each name's own entry of
    ``owner.__dict__`` (an instance attribute, a module's global) as it was: the same object, or absent again (the
    class's attribute showing through). Nested patches of the same name restore in order."""
    own = vars(owner)
    saved = [(name, own.get(name, _ABSENT)) for name in values]
    try:
        for name, value in values.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, before in reversed(saved):
            if before is _ABSENT:
                own.pop(name, None)
            else:
                setattr(owner, name, before)
