"""What the trainer step and the actor worker exchange: the non-tensor keys the step attaches to the batch, and the
fields ``compute_token_importance`` returns. A module of names only, so that the plugin's import chain (trainer ->
step) never needs the worker module, which imports verl's workers."""

# non-tensor entries the step attaches to the batch (prefixed: extra_info entries persist for later RPCs)
CONFIG_KEY = "oar_config"
STEP_KEY = "oar_global_step"
GROUND_TRUTH_KEY = "oar_ground_truth"

# the step's fidelity measurement (oar_verl.core.fidelity.step.step_fidelity), per row as oar_fidelity_<name>: NaN
# on rows not measured and on steps not due (aopc_entropy: on every row until the worker passes the policy's entropy);
# ``seconds`` is the rank's time measuring
FIDELITY_FIELDS = ("aopc", "aopc_random", "aopc_position", "aopc_entropy", "static", "suppression", "seconds")

# what compute_token_importance returns: per row (nested, response-aligned) and per sequence
OUTPUT_FIELDS = ("token_importance", "oar_reasoning_mask", "oar_answer_mask", "oar_span_found", "oar_answer_probe",
                 "oar_passes", "oar_copies", "oar_refined", "oar_params_fingerprint",
                 "oar_log_prob_params_fingerprint") + tuple(f"oar_fidelity_{k}" for k in FIDELITY_FIELDS)
