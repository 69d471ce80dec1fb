"""The tested release of a training framework an adapter hooks into (OpenRLHF, TRL): another release can move what
the adapter relies on without any error, so it is refused, naming both versions, unless the user opts in."""

from __future__ import annotations

import os
import warnings


def check_tested_release(found: str, tested: str, *, framework: str, extra: str, allow_env: str,
                         allow_untested: bool | None, error: type[Exception], digits: int = 3) -> str:
    """Return ``found`` when its first ``digits`` release numbers are ``tested``'s (``"1.16"`` with 2: any 1.16.x);
    otherwise raise ``error`` naming both, or, with ``allow_untested`` (default: ``allow_env`` set to ``1``), warn."""
    if allow_untested is None:
        allow_untested = os.environ.get(allow_env, "0") == "1"
    if ".".join(found.split("+")[0].split(".")[:digits]) == tested:
        return found
    message = (f"{framework} {found} is installed; the OAR adapter is tested with {framework} {tested}"
               f"{'.x' if digits < 3 else ''} only (pip install \"oar-verl[{extra}]\" installs it)")
    if not allow_untested:
        raise error(f"{message}; set {allow_env}=1 to run on {found} anyway and check that the oar/* metrics appear "
                    "in the logs")
    warnings.warn(f"{message}; running anyway ({allow_env}=1)", stacklevel=3)
    return found
