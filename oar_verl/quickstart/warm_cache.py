"""Warm-started models shared between benchmark runs, keyed by content.

A warm start (a supervised pre-training of a tiny Qwen2 on the digit-sum or last-digit task) is a pure function of its
settings, its seed and the code that builds and trains it. ``materialise`` keys a directory on exactly that (the
settings as JSON, the library versions and a hash of the source files named by the caller), so two benchmark runs that
ask for the same warm start train it once: the first builds it into the cache, the others copy it. The cache lives in
``$OAR_WARM_CACHE``; without it nothing is cached and every run trains its own.
The test suite points it at one directory per test session, shared by its xdist workers (conftest.py at the
repository root); an entry being built is locked, so concurrent runs build it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

ENV = "OAR_WARM_CACHE"


def content_key(settings: dict, code_files: Iterable[str | Path]) -> str:
    """sha256 (hex, 24 digits) of the settings, torch / transformers versions and the named source files' bytes."""
    import torch
    import transformers

    h = hashlib.sha256(json.dumps({"settings": settings, "torch": torch.__version__,
                                   "transformers": transformers.__version__}, sort_keys=True, default=str).encode())
    for f in sorted(str(Path(f).resolve()) for f in code_files):
        h.update(Path(f).name.encode())
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:24]


def materialise(target: str | Path, *, name: str, settings: dict, code_files: Iterable[str | Path],
                build: Callable[[Path], None], log: Callable[[str], None] = print) -> bool:
    """Fill the directory ``target`` with what ``build(target)`` writes there, from the cache when an entry with the
    same content key exists. Returns True on a cache hit. ``name`` only labels the cache entry."""
    target = Path(target)
    root = os.environ.get(ENV)
    if not root:
        build(target)
        return False
    entry = Path(root) / f"{name}-{content_key(settings, code_files)}"
    entry.parent.mkdir(parents=True, exist_ok=True)
    # one builder per entry: a concurrent run asking for the same entry waits for it instead of training it again
    with open(entry.with_name(f"{entry.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if entry.is_dir():
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(entry, target)
            log(f"[warm-cache] {name}: reusing {entry}")
            return True
        build(target)
        # copy then rename: a reader that does not take the lock sees either no entry or a complete one
        tmp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex[:8]}")
        shutil.copytree(target, tmp)
        tmp.rename(entry)
    log(f"[warm-cache] {name}: stored {entry}")
    return False
