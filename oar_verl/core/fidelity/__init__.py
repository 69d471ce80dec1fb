"""The deletion-based fidelity metric: how faithfully a token ranking finds what the outcome depends on, offline on
any model and inside the training step (docs/fidelity.md).

Rooms by job: :mod:`.curves` (which tokens each ranking removes at each fraction), :mod:`.controls` (the free rankings a
method must beat: random, position, entropy), :mod:`.operators` (how a token is removed: OAR-P's mask operators plus
``delete``), :mod:`.shifts` (the one scorer of removal sets, on any backend), :mod:`.summary` (gain over a control,
AOPC, NAOPC, S, mass on target, clustered bootstrap intervals), :mod:`.report` (the offline :func:`fidelity_report`)
and :mod:`.step` (the in-step metric logged as ``oar/fidelity/*``).
"""

from oar_verl.core.fidelity.controls import (CONTROLS, DEFAULT_CONTROLS, Control, check_controls, control_scores,
                                             entropy_from_logits, entropy_scores)
from oar_verl.core.fidelity.curves import (FRACTIONS, bottom_removal, deletion_sets, full_columns, position_scores,
                                           random_scores, rankings, ranks_from_scores, removal_count, row_keys,
                                           top_removal)
from oar_verl.core.fidelity.operators import (DEFAULT_OPERATORS, DELETE, OPERATORS, RENAMED, check_operators,
                                              resample_tokens)
from oar_verl.core.fidelity.report import (FidelityReport, MethodFidelity, fidelity_report, leave_one_out_scores,
                                           outcome_shifts)
from oar_verl.core.fidelity.shifts import MEASURES, removal_shifts, rows_of
from oar_verl.core.fidelity.step import (CONTROL_FIELDS, FIELDS, RANDOM_RANKINGS, deletion_metrics, due, removal_sets,
                                         step_fidelity, step_metrics)
from oar_verl.core.fidelity.summary import (Interval, aopc, bootstrap_mean, bootstrap_ratio, clusters, default_min_gap,
                                            gain, mass_on_target, naopc, ratio_of_sums, static_rows,
                                            suppression_ratio)

__all__ = [
    "CONTROLS", "CONTROL_FIELDS", "DEFAULT_CONTROLS", "DEFAULT_OPERATORS", "DELETE", "FIELDS", "FRACTIONS", "MEASURES",
    "OPERATORS", "RANDOM_RANKINGS", "RENAMED", "Control", "FidelityReport", "Interval", "MethodFidelity", "aopc",
    "bootstrap_mean", "bootstrap_ratio", "bottom_removal", "check_controls", "check_operators", "clusters",
    "control_scores", "default_min_gap", "deletion_metrics", "deletion_sets", "due", "entropy_from_logits",
    "entropy_scores", "fidelity_report", "full_columns", "gain", "leave_one_out_scores", "mass_on_target", "naopc",
    "outcome_shifts", "position_scores", "random_scores", "rankings", "ranks_from_scores", "ratio_of_sums",
    "removal_count", "removal_sets", "removal_shifts", "resample_tokens", "row_keys", "rows_of", "static_rows",
    "step_fidelity", "step_metrics", "suppression_ratio", "top_removal",
]
