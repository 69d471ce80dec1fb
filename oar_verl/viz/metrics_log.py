"""verl's ``file`` logger output: where a run's metrics JSONL lies and how to read it (curves, launcher, benchmarks)."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["metrics_file", "read_metrics"]


def metrics_file(file_logger_root: str | os.PathLike, project: str, experiment: str) -> Path:
    """Where verl's ``file`` logger writes: ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``."""
    return Path(file_logger_root) / project / f"{experiment}.jsonl"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read a verl file-logger JSONL into one flat dict per logged step (``{"step": n, **metrics}``).

    Returns an empty list if the file does not exist.
    """
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows.append({"step": record["step"], **record["data"]})
    return rows
