"""The deletion-based fidelity metric: how faithfully a token ranking finds what the outcome depends on, offline on
any model and inside the training step (docs/fidelity.md).

Rooms by job: :mod:`.curves` (which tokens each ranking removes at each fraction), :mod:`.operators` (how a token is
removed: OAR-P's mask operators plus ``delete``), :mod:`.shifts` (the one scorer of removal sets, on any backend),
:mod:`.summary` (AOPC, NAOPC, S, mass on target, bootstrap intervals), :mod:`.report` (the offline
:func:`fidelity_report`) and :mod:`.step` (the in-step metric logged as ``oar/fidelity/*``).
"""

from oar_verl.core.fidelity.curves import (FRACTIONS, bottom_removal, deletion_sets, position_scores, random_scores,
                                           rankings, ranks_from_scores, removal_count, row_keys, top_removal)
from oar_verl.core.fidelity.operators import (DEFAULT_OPERATORS, DELETE, OPERATORS, RENAMED, check_operators,
                                              resample_tokens)
from oar_verl.core.fidelity.report import (FidelityReport, MethodFidelity, fidelity_report, leave_one_out_scores,
                                           outcome_shifts)
from oar_verl.core.fidelity.shifts import MEASURES, removal_shifts, rows_of
from oar_verl.core.fidelity.step import (FIELDS, RANDOM_RANKINGS, deletion_metrics, due, removal_sets, step_fidelity,
                                         step_metrics)
from oar_verl.core.fidelity.summary import (Interval, aopc, bootstrap_mean, default_min_gap, mass_on_target, naopc,
                                            suppression_ratio)

__all__ = [
    "DEFAULT_OPERATORS", "DELETE", "FIELDS", "FRACTIONS", "MEASURES", "OPERATORS", "RANDOM_RANKINGS", "RENAMED",
    "FidelityReport", "Interval", "MethodFidelity", "aopc", "bootstrap_mean", "bottom_removal", "check_operators",
    "default_min_gap", "deletion_metrics", "deletion_sets", "due", "fidelity_report", "leave_one_out_scores",
    "mass_on_target", "naopc", "outcome_shifts", "position_scores", "random_scores", "rankings", "ranks_from_scores",
    "removal_count", "removal_sets", "removal_shifts", "resample_tokens", "row_keys", "rows_of", "step_fidelity",
    "step_metrics", "suppression_ratio", "top_removal",
]
