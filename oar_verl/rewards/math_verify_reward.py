"""verl custom reward for GSM8K / MATH / MATH-500: a strict GSM8K fast path, then math-verify in a subprocess pool.

Use it in verl with::

    reward.custom_reward_function.path=pkg://oar_verl.rewards.math_verify_reward
    reward.custom_reward_function.name=compute_score
    # optional: +reward.custom_reward_function.reward_kwargs.timeout_s=10
    # optional: +reward.custom_reward_function.reward_kwargs.gsm8k_fallback=False  (the tool recipes)

math-verify runs in the main thread of ``spawn`` worker processes, so that its ``signal.alarm`` timeouts work under
verl's threaded reward loop and a pathological answer scores 0 after ``timeout_s`` instead of hanging it; a script
that calls :func:`compute_score` at top level therefore needs an ``if __name__ == "__main__":`` guard. Scoring
rules, the reason for the pool, ``OAR_GRADER_TIMEOUT_S`` and ``OAR_GRADER_WORKERS``: docs/verl.md, "The recipes' data
and reward".

Only the model's own words are graded. On a multi-turn row of verl's tool agent loop ``solution_str`` is the whole
decoded response, tool outputs included; :func:`model_turns` cuts the tool outputs out first (the layout recognised:
hermes rounds, :data:`ROUND_START` … :data:`ROUND_END`) and a GSM8K row that is multi-turn is graded by the strict
``#### N`` rule alone, so a number that only a tool printed earns nothing (:func:`compute_score`).
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

from oar_verl.core.text.answer_patterns import find_answer_span

__all__ = ["DEFAULT_TIMEOUT_S", "ROUND_END", "ROUND_START", "compute_score", "gsm8k_strict", "math_verify_score", "model_turns",
           "shutdown_pool"]

logger = logging.getLogger("oar_verl")

DEFAULT_TIMEOUT_S = float(os.environ.get("OAR_GRADER_TIMEOUT_S", "10"))
MAX_WORKERS = int(os.environ.get("OAR_GRADER_WORKERS", str(min(4, os.cpu_count() or 1))))
_CANONICAL_MODULE = "oar_verl.rewards.math_verify_reward"

def _to_number(text: str) -> float | None:
    """``"1,234.50"`` / ``"$72"`` / ``"72."`` -> float; None when it is not a plain number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def gsm8k_strict(solution_str: str, ground_truth: str) -> float | None:
    """Strict GSM8K grading on the last ``#### N`` of the response, found by the very pattern OAR's answer span uses
    (:func:`oar_verl.core.text.answer_patterns.find_answer_span` with ``gsm8k``: spaces or tabs after ``####``, an
    optional ``$``, thousands commas in groups of three), so the number the reward reads is the span OAR reads.

    Returns:
        1.0 / 0.0 when the response has a ``#### N`` number and the ground truth is a number; None when the fast path
        cannot decide (no ``#### N``, or a non-numeric ground truth): :func:`compute_score` decides what follows.
    """
    truth = _to_number(str(ground_truth))
    text = solution_str.encode("utf-8")
    span = find_answer_span(text, ("gsm8k",))
    if span is None or truth is None:
        return None
    predicted = _to_number(text[span[1]:span[2]].decode("utf-8", "replace"))
    if predicted is None:
        return None
    return 1.0 if abs(predicted - truth) <= 1e-6 * max(1.0, abs(truth)) else 0.0


# --------------------------------------------------------------------------------------------------------------------
# the model's own text of a multi-turn response
# --------------------------------------------------------------------------------------------------------------------

# One round of tool outputs as verl's ToolAgentLoop appends it (the ``tool`` role through the chat template, then the
# generation prompt) and the reward manager decodes it (``skip_special_tokens=True``), in the hermes layout of
# Qwen2.5's and Qwen3's templates (``multi_turn.format=hermes``):
#     "\nuser\n<tool_response>\n68\n</tool_response>\n<tool_response>\n7\n</tool_response>\nassistant\n"
# (the leading "\n" is the one verl's Qwen builder adds after the model's <|im_end|>; a round of parallel calls holds
# several blocks). A round starts at the template's role line (ROUND_START: a "<tool_response>" the model writes in its
# own text is not one) and ends at the LAST ROUND_END before the next round starts (a tool output that itself holds
# "</tool_response>\nassistant\n" cannot end its round early); one that never ends runs to the end of the text (a
# truncated response: what follows it is not the model's).
ROUND_START = re.compile(r"(?:^|\n)user\n<tool_response>")
ROUND_END = "</tool_response>\nassistant\n"


def model_turns(solution_str: str, rounds: int | None = None) -> list[str] | None:
    """The model's own text of a decoded response, one string per assistant turn, tool outputs cut out.

    Recognised: hermes ``<tool_response>`` rounds (:data:`ROUND_START` … :data:`ROUND_END`: Qwen2.5 / Qwen3 chat
    templates with verl's ``multi_turn.format=hermes``, the GSM8K tool recipes' layout). Any other layout is not
    recognised: the response is one turn, kept whole. The model's tool calls (``<tool_call>…</tool_call>``) are its own
    words and stay.

    Args:
        solution_str: the decoded response.
        rounds: the rounds of tool outputs the agent loop appended, when known (verl's ``num_turns``: 1 + assistant
            turns + tool rounds, so ``(num_turns - 1) // 2``): 0 keeps the text whole (a single-turn row: whatever it
            holds, the model wrote it); more round starts than ``rounds`` means some were written by the model or a
            tool, and which are real cannot be told.

    Returns:
        ``[solution_str]`` when no round is found or ``rounds == 0``; else the k+1 turns around the k rounds, in order
        (a turn may be empty); None where the rounds are ambiguous (more starts than ``rounds``).
    """
    if rounds == 0:
        return [solution_str]
    starts = [m.start() for m in ROUND_START.finditer(solution_str)]
    if rounds is not None and len(starts) > rounds:
        return None
    turns, pos = [], 0
    for i, start in enumerate(starts):  # per round, not per token
        turns.append(solution_str[pos:start])
        limit = starts[i + 1] if i + 1 < len(starts) else len(solution_str)
        end = solution_str.rfind(ROUND_END, start, limit)
        pos = limit if end < 0 else end + len(ROUND_END)
    turns.append(solution_str[pos:])
    return turns


def _num_turns(extra_info) -> int | None:
    """verl's turn count of the row (``extra_info["num_turns"]``: user + assistant turns + 1, 2 on a single turn)."""
    value = extra_info.get("num_turns") if isinstance(extra_info, dict) else None
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"extra_info['num_turns'] must be an integer (verl's agent-loop turn count) or None; "
                         f"got {value!r}") from None


# the row layouts the grader cannot read (a warning each, logged once a process)
LAYOUT_WARNINGS = {
    "unrecognised": "a row has num_turns=%d but no hermes <tool_response> round: its tool outputs (if any) cannot be "
                    "told from the model's words, so the whole response is graded (GSM8K: strict #### N only). "
                    "Recognised layout: Qwen2.5/Qwen3 chat templates with multi_turn.format=hermes.",
    "ambiguous": "a row holds more <tool_response> rounds than its num_turns=%d allows: the model or a tool wrote a "
                 "round of its own, and the model's words cannot be told from the tools'; scored 0.",
}
_warned: set[str] = set()


def _warn_once(kind: str, num_turns: int) -> None:
    """Log :data:`LAYOUT_WARNINGS` ``[kind]`` once a process."""
    if kind not in _warned:
        _warned.add(kind)
        logger.warning(LAYOUT_WARNINGS[kind] + " Logged once.", num_turns)


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
                  gsm8k_fallback: bool = True, **kwargs) -> float:
    """verl custom reward: 1.0 for a correct final answer in the model's own words, else 0.0.

    Tool outputs are never graded: :func:`model_turns` cuts them out of ``solution_str`` first (hermes
    ``<tool_response>`` rounds, counted against ``extra_info["num_turns"]``: a row with more rounds in its text than
    the agent loop appended scores 0; other layouts are kept whole, so a tool output in them can still be read).

    GSM8K rows (``data_source`` containing ``gsm8k``) are graded on the **last** ``#### N`` among the model's own turns,
    searched from the final turn back (a match never spans a tool output), like verl's strict GSM8K scorer
    (``verl.utils.reward_score.gsm8k``, ``method="strict"``) on the model's text, and like OAR's answer span (the last
    span among the model's own tokens: oar_verl/core/text/turns.py): an answer stated in an earlier turn and not
    restated later counts. The ``#### N`` pattern is OAR's own (:func:`gsm8k_strict`); where it and verl's scorer
    differ is listed in docs/verl.md and held by tests/rewards. A row without ``#### N``:

    * **multi-turn** (a tool output found, or ``extra_info["num_turns"] > 2``): 0.0, no math-verify fallback (a
      fallback would read numbers the model did not state as its answer);
    * **single-turn**: math-verify on the response (the fallback kept from before, for models that answer in
      ``\\boxed{}`` or prose), unless ``gsm8k_fallback=False`` (the tool recipes: every row of a run graded by the one
      strict rule, whether it called the tool or not).

    Other rows (MATH, MATH-500) and a non-numeric GSM8K ground truth: math-verify on the model's turns (tool outputs
    cut out).

    Args:
        data_source: dataset name.
        solution_str: the decoded response (verl: every turn, tool outputs included).
        ground_truth: the reference answer (``reward_model.ground_truth``), e.g. ``"72"`` or ``"\\frac{1}{2}"``.
        extra_info: verl's row info; ``num_turns`` (None or an int) is read, the rest ignored.
        timeout_s: outer timeout of the math-verify call (default ``OAR_GRADER_TIMEOUT_S``, 10 s).
        gsm8k_fallback: whether single-turn GSM8K rows without ``#### N`` go to math-verify (``reward_kwargs``).
        kwargs: accepted for verl's calling convention and ignored.

    Raises:
        ValueError: ``gsm8k_fallback`` is not a bool, or ``extra_info["num_turns"]`` is not an integer.
    """
    if not isinstance(gsm8k_fallback, bool):
        raise ValueError("reward.custom_reward_function.reward_kwargs.gsm8k_fallback must be True or False; "
                         f"got {gsm8k_fallback!r}")
    num_turns = _num_turns(extra_info)
    if not solution_str or ground_truth is None:
        return 0.0
    ground_truth = str(ground_truth)
    turns = model_turns(solution_str, None if num_turns is None else max(num_turns - 1, 0) // 2)
    if turns is None:  # more tool rounds in the text than the agent loop appended: a fake one, and no telling which
        _warn_once("ambiguous", num_turns)
        return 0.0
    multi_turn = len(turns) > 1 or (num_turns is not None and num_turns > 2)
    if len(turns) == 1 and multi_turn:
        _warn_once("unrecognised", num_turns)
    if _is_gsm8k(data_source) and _to_number(ground_truth) is not None:
        for turn in reversed(turns):
            strict = gsm8k_strict(turn, ground_truth)
            if strict is not None:
                return strict
        if multi_turn or not gsm8k_fallback:
            return 0.0
    return math_verify_score("\n".join(turns), ground_truth, timeout_s)


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
