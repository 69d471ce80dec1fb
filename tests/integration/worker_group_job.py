"""Run ``compute_token_importance`` on a real Ray worker group of the OAR worker (FSDP2, gloo, CPU).

Launched by test_worker_group_on_cpu.py in a fresh process (the CPU platform must be selected before verl is first
imported). Builds the group exactly like verl's trainers do (``create_colocated_worker_cls`` + ``spawn``, in
job_support.py), calls the RPC on a nested TensorDict whose data-parallel shards hold different lengths, and saves
inputs and outputs.

usage: python worker_group_job.py MODEL_DIR OUT_FILE N_RANKS MODE RAY_TMP [TARGET [SP [PACKED [STRATEGY]]]]

MODE: gradient, perturbation (exact OAR-P) or hierarchical (OAR-P's hierarchical policy).

SP > 1: Ulysses sequence parallelism of that size, so the ranks form sequence-parallel groups instead of data-parallel
ranks, with verl's bucket padding of the packed rows (``pad_to_length``, a bucket of BUCKET tokens: each rank's shard
holds more positions than the micro-batch's real tokens). PACKED (1; implied by SP > 1): verl's remove-padding layout
(rows packed end to end, the CPU stand-in attention ``ulysses_sdpa``). STRATEGY: fsdp2 (default) or fsdp (FSDP1, verl's default; :mod:`devtools.fsdp1_cpu`).
With MODE gradient or gradient_k3, also fisher read from verl's old-log-prob pass (docs/method.md §14; the ranks'
micro-batches of different lengths, sharded under SP) and fisher's own call, and OAR-G with its clean teachers read
from that pass and its noisy passes on the marked rows after it. The old-log-prob calls compute the entropies, as verl's
trainers call them (``calculate_entropy=True``); OAR-G measures the step's fidelity in them (``fidelity_every=1``)
with the pass's entropies as the entropy control, and under SP also in ``compute_token_importance`` with the batch's;
every rank's measurements are saved (``rank_fidelity``, :class:`job_support.FidelityRecordingWorker`).

The actor runs with gradient checkpointing, and attribution with a token budget of 100 tokens per pass, so that the
two ranks need different numbers of passes (short rows share passes on rank 0, long rows run alone on rank 1).
"""

from __future__ import annotations

import sys

import torch

from verl.utils import tensordict_utils as tu

from oar_verl.core.config import OARConfig
from oar_verl.integration.fields import (ATTRIBUTE_FIELD, CONFIG_KEY, FIDELITY_FIELDS, SECONDS_FIELD, SHARED_KEY,
                                         STEP_KEY)
from oar_verl.integration.worker import pass_entropies
from devtools.verl_group import rows_tensordict
from job_support import FidelityRecordingWorker, actor_group, saved, tokenized, trainer_config

# Rank 0 gets the first half of the batch: short responses there, long ones on rank 1.
RESPONSES = ["The answer is 7.", "12 plus 30 is 42. The answer is 42.",
             "5 plus 9: count up from 5 by nine steps, which gives 14. The answer is 14.",
             "Seven and eight make fifteen, so #### 15"]
GROUND_TRUTHS = ["7", "42", "14", "15"]
BUDGET = 100
# under SP, verl pads each packed micro-batch (one row) to a multiple of BUCKET tokens before slicing it: every shard
# (BUCKET / SP positions) is longer than the row's real tokens
BUCKET = 256
# the rows marked for OAR-G's noisy passes after the pass (ATTRIBUTE_FIELD): rank 0 holds rows 0-1, rank 1 rows 2-3
TEACHER_ROWS = {"gradient": [0, 1, 1, 1], "gradient_k3": [0, 0, 1, 1]}


def main() -> None:
    model_dir, out_file, n_ranks, mode, ray_tmp = sys.argv[1:6]
    target = sys.argv[6] if len(sys.argv) > 6 else "response"
    sp = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    packed = sp > 1 or (len(sys.argv) > 8 and sys.argv[8] == "1")
    strategy = sys.argv[9] if len(sys.argv) > 9 else "fsdp2"
    n_ranks = int(n_ranks)
    _, prompts, responses = tokenized(model_dir, RESPONSES)
    prompts, responses = [torch.tensor(p) for p in prompts], [torch.tensor(r) for r in responses]
    bucket = ("actor_rollout_ref.actor.pad_to_length=True",
              f"actor_rollout_ref.actor.fsdp_config.pad_to_length_bucket={BUCKET}") if sp > 1 else ()
    if sp > 1:
        assert max(len(p) + len(r) for p, r in zip(prompts, responses)) < BUCKET // sp, "no shard longer than its row"
    cfg = trainer_config(model_dir, n_ranks=n_ranks, batch_size=2, micro_batch_size=1, sp=sp, checkpointing=True,
                         packed=packed, strategy=strategy, extra=bucket)
    with actor_group(FidelityRecordingWorker, cfg, ray_tmp, n_ranks) as wg:
        data = rows_tensordict(prompts, responses)
        # "hierarchical": OAR-P's segment level, then exact OAR-P inside the top segments (the ranks need different
        # numbers of passes at each level, known only after the first)
        # "gradient_k3": OAR-G with 3 noise draws per sequence (draw rows packed under the same budget)
        policy = {"mode": "perturbation", "perturbation": "hierarchical", "segment_min_tokens": 1,
                  "segment_max_tokens": 4, "refine_share": 0.3} if mode == "hierarchical" else \
            {"mode": "gradient", "noise_samples": 3} if mode == "gradient_k3" else {"mode": mode}
        # OAR-G also measures the step's fidelity (the first row of each rank: the ranks need different pass counts)
        fidelity = {"fidelity_every": 1, "fidelity_rows": 1} if mode == "gradient" else {}
        oar = OARConfig(**policy, **fidelity, probe="as_mean", max_token_len_per_gpu=BUDGET, target=target)
        # verl's RL datasets store the ground truth with every sample; target=reference reads it from there
        tu.assign_non_tensor(data, reward_model=[{"ground_truth": g, "style": "rule"} for g in GROUND_TRUTHS])
        logp_data = data.clone()
        tu.assign_non_tensor(logp_data, temperature=1.0, compute_loss=False, calculate_entropy=True)  # as verl's
        plain = wg.compute_log_prob(logp_data.clone())
        before = plain["log_probs"]
        if sp > 1:  # the V1 trainers' batch carries the old-log-prob entropies (the entropy control's)
            data["entropy"] = torch.nested.as_nested_tensor(pass_entropies(plain, responses), layout=torch.jagged)
        tu.assign_non_tensor(data, **{CONFIG_KEY: oar.to_dict(), STEP_KEY: 3})
        out = wg.compute_token_importance(data)
        after = wg.compute_log_prob(logp_data.clone())["log_probs"]
        extra = {}
        if mode.startswith("gradient"):  # fisher read from verl's old-log-prob pass, and its own call
            fisher = OARConfig(mode="fisher", probe="as_mean", max_token_len_per_gpu=BUDGET, target=target)
            shared_data = logp_data.clone()
            tu.assign_non_tensor(shared_data, **{SHARED_KEY: {CONFIG_KEY: fisher.to_dict(), STEP_KEY: 3}})
            shared = wg.compute_log_prob(shared_data)
            own = data.clone()
            tu.assign_non_tensor(own, **{CONFIG_KEY: fisher.to_dict(), STEP_KEY: 3})
            fisher_own = wg.compute_token_importance(own)
            extra = {"shared_log_probs": saved(shared["log_probs"]), "shared": shared["oar_shared"].clone(),
                     "shared_importance": saved(shared["token_importance"]),
                     "shared_seconds": shared[SECONDS_FIELD].clone(),
                     "fisher_importance": saved(fisher_own["token_importance"]),
                     "fisher_seconds": fisher_own[SECONDS_FIELD].clone()}
            # OAR-G's clean teachers read from the pass, its noisy passes after it on the marked rows only (with K = 3
            # none of rank 0's rows: that rank still runs the passes the other needs)
            teacher_data = logp_data.clone()
            marked = torch.tensor(TEACHER_ROWS[mode], dtype=torch.float32)
            teacher_data[ATTRIBUTE_FIELD] = marked
            tu.assign_non_tensor(teacher_data, **{SHARED_KEY: {CONFIG_KEY: oar.to_dict(), STEP_KEY: 3}})
            taught = wg.compute_log_prob(teacher_data)
            extra.update({"teacher_log_probs": saved(taught["log_probs"]),
                          "teacher_shared": taught["oar_shared"].clone(),
                          "teacher_importance": saved(taught["token_importance"]), "teacher_rows": marked,
                          "teacher_seconds": taught[SECONDS_FIELD].clone(),
                          "teacher_fidelity": taught["oar_fidelity_aopc"].clone(), "ranks": n_ranks // sp})
        extra["rank_fidelity"] = wg.fidelity_records()  # every rank's measurements, rank by rank
        torch.save({**extra, "prompts": prompts, "responses": responses, "config": oar.to_dict(), "truths": GROUND_TRUTHS,
                    "token_importance": saved(out["token_importance"]), "reasoning": saved(out["oar_reasoning_mask"]),
                    "answer": saved(out["oar_answer_mask"]),
                    "span_found": out["oar_span_found"].clone(),
                    "answer_probe": out["oar_answer_probe"].clone(),
                    "rounds": out["oar_passes"].clone(), "copies": out["oar_copies"].clone(),
                    "seconds": out[SECONDS_FIELD].clone(),
                    "refined": out["oar_refined"].clone(),
                    "fidelity": {k: out[f"oar_fidelity_{k}"].clone() for k in FIDELITY_FIELDS},
                    "log_probs_before": saved(before), "log_probs_after": saved(after)}, out_file)


if __name__ == "__main__":
    main()
