"""verl custom reward for GSM8K / MATH / MATH-500: a strict GSM8K fast path, then math-verify in a subprocess pool.

Use it in verl with::

    reward.custom_reward_function.path=pkg://oar_verl.rewards.math_verify_reward
    reward.custom_reward_function.name=compute_score
    # optional: +reward.custom_reward_function.reward_kwargs.timeout_s=10

math-verify runs in the main thread of ``spawn`` worker processes, so that its ``signal.alarm`` timeouts work under
verl's threaded reward loop and a pathological answer scores 0 after ``timeout_s`` instead of hanging it; a script
that calls :func:`compute_score` at top level therefore needs an ``if __name__ == "__main__":`` guard. Scoring
rules, the reason for the pool, ``OAR_GRADER_TIMEOUT_S`` and ``OAR_GRADER_WORKERS``: docs/verl.md, "The recipes' data
and reward".
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import os
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeoutError
from concurrent.futures.process import BrokenProcessPool

__all__ = ["DEFAULT_TIMEOUT_S", "compute_score", "gsm8k_strict", "math_verify_score", "shutdown_pool"]

logger = logging.getLogger("oar_verl")

DEFAULT_TIMEOUT_S = float(os.environ.get("OAR_GRADER_TIMEOUT_S", "10"))
MAX_WORKERS = int(os.environ.get("OAR_GRADER_WORKERS", str(min(4, os.cpu_count() or 1))))
_CANONICAL_MODULE = "oar_verl.rewards.math_verify_reward"

# "#### N": optional "$", sign, digits with optional thousands commas, optional decimals.
_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")


def _to_number(text: str) -> float | None:
    """``"1,234.50"`` / ``"$72"`` / ``"72."`` -> float; None when it is not a plain number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def gsm8k_strict(solution_str: str, ground_truth: str) -> float | None:
    """Strict GSM8K grading on the last ``#### N`` of the response.

    Returns:
        1.0 / 0.0 when the response has a ``#### N`` number and the ground truth is a number; None when the fast path
        cannot decide (no ``#### N``, or a non-numeric ground truth), so the caller falls back to math-verify.
    """
    matches = _GSM8K_ANSWER.findall(solution_str)
    truth = _to_number(str(ground_truth))
    if not matches or truth is None:
        return None
    predicted = _to_number(matches[-1])
    if predicted is None:
        return None
    return 1.0 if abs(predicted - truth) <= 1e-6 * max(1.0, abs(truth)) else 0.0


# --------------------------------------------------------------------------------------------------------------------
# math-verify, in the main thread of a spawned worker process
# --------------------------------------------------------------------------------------------------------------------


def _wrap_gold(ground_truth: str) -> str:
    """math-verify's LaTeX extraction needs a delimiter around the gold answer."""
    gt = ground_truth.strip()
    return gt if ("\\boxed" in gt or gt.startswith("$")) else "\\boxed{" + gt + "}"


def _strip_percent(text: str) -> str:
    return text.replace("\\%", "").replace("%", "")


def _verify_worker(solution_str: str, ground_truth: str, inner_timeout_s: int) -> float:
    """Runs in a pool worker's main thread, where math-verify's ``signal.alarm`` timeouts work."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    def once(prediction: str, gold: str) -> bool:
        gold_parsed = parse(_wrap_gold(gold), (LatexExtractionConfig(),), parsing_timeout=inner_timeout_s)
        pred_parsed = parse(prediction, (LatexExtractionConfig(), ExprExtractionConfig()),
                            parsing_timeout=inner_timeout_s)
        return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=inner_timeout_s))

    if once(solution_str, ground_truth):
        return 1.0
    if "%" in solution_str or "%" in ground_truth:
        return 1.0 if once(_strip_percent(solution_str), _strip_percent(ground_truth)) else 0.0
    return 0.0


def _warmup() -> int:
    import math_verify  # noqa: F401  (sympy + antlr: slow to import, paid once per worker, outside any call's timeout)

    return os.getpid()


_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """SIGKILL a pool's worker processes (``ProcessPoolExecutor`` has no public terminate before Python 3.14)."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            proc.kill()
        except Exception:  # already gone
            pass
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown_pool() -> None:
    """Kill the worker pool (a later call creates a fresh one). Registered to run at interpreter exit."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        _kill_workers(pool)


def _get_pool() -> ProcessPoolExecutor:
    """The module-level pool, created on first use with every worker started and math-verify imported."""
    global _pool
    with _pool_lock:
        if _pool is None:
            pool = ProcessPoolExecutor(max_workers=MAX_WORKERS, mp_context=multiprocessing.get_context("spawn"))
            for future in [pool.submit(_warmup) for _ in range(MAX_WORKERS)]:
                future.result(timeout=300)
            _pool = pool
        return _pool


def _discard(pool: ProcessPoolExecutor) -> None:
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    _kill_workers(pool)


def math_verify_score(solution_str: str, ground_truth: str, timeout_s: float | None = None) -> float:
    """math-verify equivalence (1.0 / 0.0) in the subprocess pool; 0.0 after ``timeout_s`` seconds (and the pool is
    replaced). Safe to call from any thread."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    inner = max(1, int(timeout_s) - 1)  # math-verify's own alarms, so a slow case usually ends without a pool kill
    for attempt in range(2):
        pool = _get_pool()
        try:
            return pool.submit(_verify_worker, solution_str, ground_truth, inner).result(timeout=timeout_s)
        except FuturesTimeoutError:
            logger.warning("math-verify timed out after %.1f s (scored 0); restarting the grader pool", timeout_s)
            _discard(pool)
            return 0.0
        except BrokenProcessPool:  # another call's timeout killed this pool mid-flight: retry once on a new one
            _discard(pool)
            if attempt == 1:
                return 0.0
        except Exception as exc:  # a math-verify error on odd input is a wrong answer, not a crash
            logger.warning("math-verify failed (%s: %s); scored 0", type(exc).__name__, exc)
            return 0.0
    return 0.0


def _is_gsm8k(data_source) -> bool:
    return "gsm8k" in str(data_source).lower()


def compute_score(data_source, solution_str, ground_truth, extra_info=None, timeout_s: float | None = None,
                  **kwargs) -> float:
    """verl custom reward: 1.0 for a correct final answer, else 0.0.

    Args:
        data_source: dataset name; GSM8K sources (``openai/gsm8k``, anything containing ``gsm8k``) take the strict
            ``#### N`` fast path first.
        solution_str: the decoded response.
        ground_truth: the reference answer (``reward_model.ground_truth``), e.g. ``"72"`` or ``"\\frac{1}{2}"``.
        extra_info, kwargs: accepted for verl's calling convention and ignored.
        timeout_s: outer timeout of the math-verify call (default ``OAR_GRADER_TIMEOUT_S``, 10 s).
    """
    if not solution_str or ground_truth is None:
        return 0.0
    ground_truth = str(ground_truth)
    if _is_gsm8k(data_source):
        fast = gsm8k_strict(solution_str, ground_truth)
        if fast is not None:
            return fast
    return math_verify_score(solution_str, ground_truth, timeout_s)


if __name__ != _CANONICAL_MODULE:
    # verl loads ``reward.custom_reward_function.path=<this file>`` under a synthetic module name
    # (``custom_module_<hash>``) that spawned workers cannot import, so nothing defined here would unpickle there.
    # Serve the calls from the installed package instead (one pool per process, whatever the load path).
    try:
        _canonical = importlib.import_module(_CANONICAL_MODULE)
        compute_score = _canonical.compute_score  # noqa: F811
        math_verify_score = _canonical.math_verify_score  # noqa: F811
        shutdown_pool = _canonical.shutdown_pool  # noqa: F811
    except ImportError:  # a copied file without the package: works only if this module is importable by name
        pass
else:
    try:  # kill the workers before concurrent.futures' own exit hook waits for them (runs first: registered later)
        threading._register_atexit(shutdown_pool)  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover - interpreter shutting down or private API gone
        pass
