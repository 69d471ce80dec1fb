"""What the trainer step and the actor worker exchange: the non-tensor keys the step attaches to the batch, and the
fields ``compute_token_importance`` returns. A module of names only, so that the plugin's import chain (trainer ->
step) never needs the worker module, which imports verl's workers."""

# non-tensor entries the step attaches to the batch (prefixed: extra_info entries persist for later RPCs)
CONFIG_KEY = "oar_config"
STEP_KEY = "oar_global_step"
GROUND_TRUTH_KEY = "oar_ground_truth"
AUTO_KEY = "oar_auto"  # on a mode=auto calibration step: {"candidates": [...]} (the workers also score each candidate)

# the step's fidelity measurement (oar_verl.core.fidelity.step.step_fidelity), per row as oar_fidelity_<name>: NaN
# on rows not measured and on steps not due (aopc_entropy also where the batch has no old-log-prob entropies);
# ``seconds`` is the rank's time measuring
FIDELITY_FIELDS = ("aopc", "aopc_random", "aopc_position", "aopc_entropy", "static", "suppression", "seconds")

# a mode=auto calibration step's measurement (oar_verl.core.auto.measure.measure_candidates), per row as
# oar_auto_<name>: ``aopc_c<i>`` candidate i's AOPC (slot i of the step's candidate list, at most AUTO_SLOTS),
# ``aopc_<control>`` (entropy: NaN where the batch has no old-log-prob entropies), ``static``; NaN on rows not
# measured and on other steps; ``spt_c<i>`` the rank's seconds per
# token of candidate i and ``tokens`` its measured tokens, on every row of the rank
AUTO_SLOTS = 8
AUTO_CONTROLS = ("random", "position", "entropy")
AUTO_FIELDS = (tuple(f"aopc_c{i}" for i in range(AUTO_SLOTS)) + tuple(f"aopc_{k}" for k in AUTO_CONTROLS)
               + ("static", "tokens") + tuple(f"spt_c{i}" for i in range(AUTO_SLOTS)))

# extra_info of verl's compute_log_prob call when attribution is read from that pass (the worker then returns the
# OUTPUT_FIELDS with the log-probs): {CONFIG_KEY: ..., STEP_KEY: ...}
SHARED_KEY = "oar_shared_forward"
# a (B,) field the worker adds to its shard so that each of verl's micro-batches names its rows
ROW_FIELD = "oar_row"
# a (B,) 0/1 field the trainer adds to the old-log-prob call's rows when the method reads only its clean teachers
# from the pass (OAR-G): the rows the step will read, whose noisy passes the worker runs after the pass; absent:
# every row
ATTRIBUTE_FIELD = "oar_attribute"

# a (B,) output field, every row of a rank alike: the rank's seconds of attribution work inside verl's old-log-prob
# call (SHARED_KEY): the backwards read from its forward or OAR-G's teacher reads and noisy passes, the fidelity
# measurement, the fallback's passes after the pass, the preparation; accelerator-synchronised at each timed segment's
# ends; the forward itself not counted (nor Megatron's shared backward, which runs inside megatron-core's schedule
# with the forward). 0 from compute_token_importance (the step's own timer holds that call)
SECONDS_FIELD = "oar_seconds"

# what compute_token_importance returns: per row (nested, response-aligned) and per sequence
OUTPUT_FIELDS = ("token_importance", "oar_reasoning_mask", "oar_answer_mask", "oar_span_found", "oar_answer_probe",
                 "oar_passes", "oar_copies", "oar_refined", "oar_params_fingerprint",
                 "oar_log_prob_params_fingerprint", "oar_recomputed", "oar_shared", SECONDS_FIELD) + \
    tuple(f"oar_fidelity_{k}" for k in FIDELITY_FIELDS) + tuple(f"oar_auto_{k}" for k in AUTO_FIELDS)
