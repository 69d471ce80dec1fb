"""Progress of long loops (warm starts, research studies) on stderr: what runs, how far, time left (tqdm, as verl's training scripts show it).

tqdm ships with transformers' dependencies, so it is there on every machine these loops run on, verl or not.
``OAR_PROGRESS=0`` silences the bars (e.g. in a log that should hold only results).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """``items`` with a progress line on stderr: description, done/total, elapsed and estimated time left.

    Outside a terminal (CI logs) the bar redraws at most every 30 s, so a log gets a line per step of a slow loop and
    no flood from a fast one."""
    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    return iter(tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=tty,
                     mininterval=0.5 if tty else 30.0, disable=os.environ.get("OAR_PROGRESS", "1") == "0",
                     leave=True))
