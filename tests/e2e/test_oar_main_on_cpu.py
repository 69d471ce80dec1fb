"""End to end: OAR inside verl's real trainer on CPU (Ray, TransferQueue, FSDP2 engine workers, vLLM-CPU rollout).

``python -m oar_verl.main`` runs, for 3 steps each, OAR-P (auto policy: hierarchical on long rows, exact on short ones)
on the V1 sync trainer in rollout-correction bypass mode (old log-probs from the rollout) with verl's FSDP1 engine
(``strategy=fsdp``, verl's default; ``devtools/fsdp1_cpu.py`` on CPU ranks), OAR-G on verl's ``colocate_async`` trainer
(its clean teachers read from the old-log-prob forward, the actor in bf16) over verl's multi-turn agent loop with a
calculator tool (docs/multi_turn.md: tool calls in the rows, the tool tokens' advantages GRPO's bit for bit, the span
in the final turn, the mass on the model's tokens) and ``mode=auto`` with its default candidates on the legacy
``RayPPOTrainer`` with a LoRA actor (read from that forward once decided); and OAR-G on the V1 trainer at scale
settings -- 2 data-parallel ranks, dynamic batch sizes, a bf16 actor with gradient checkpointing and a token budget
that needs several attribution passes per rank -- saved at step 1 and resumed to step 2. From verl's file-logger JSONL,
every step must carry the ``oar/*`` metrics and ``timing_s/oar`` (with the part inside the old-log-prob call,
``timing_s/oar_in_old_log_prob``, and their sum ``timing_s/oar_total``); the token weights must be non-uniform while
every sequence keeps its advantage mass; and the policy must update. Bad configurations must fail before any rollout,
naming the key.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest

from oar_verl.quickstart.launcher import cpu_env, main_ppo_overrides, new_ray_temp_dir, run_main_ppo
from oar_verl.quickstart import arith_reward

STEPS = 3
BF16_ACTOR = ("++actor_rollout_ref.actor.fsdp_config.mixed_precision="
              "{param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}")
# verl's default strategy (the launcher names fsdp2): the actor and its engine config
FSDP1 = ["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.fsdp_config.strategy=fsdp"]
LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=all-linear"]
OAR_KEYS = ["oar/weight_mean", "oar/weight_std", "oar/weight_max", "oar/frac_floor", "oar/frac_boosted",
            "oar/ess_ratio", "oar/top10_mass", "oar/span_found_frac", "oar/adv_mass_rel_err",
            "oar/attributed_seq_frac", "oar/flat_seq_frac", "timing_s/oar", "timing_s/oar_in_old_log_prob",
            "timing_s/oar_total", "timing_s/old_log_prob"]


# verl's multi-turn agent loop with the calculator tool (the tool config's path is added per run): responses of a
# tool call, the tool's output and a final turn fit in 64 tokens
MULTI_TURN = ["actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.format=hermes",
              "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "data.max_response_length=64",
              "actor_rollout_ref.rollout.max_model_len=96"]

# the tiny random model writes no "The answer is N": its last number stands for its answer, so that its rows have the
# answer span OAR needs (a row without one keeps GRPO's weights, docs/method.md §2)
LAST_NUMBER = "algorithm.oar.answer_patterns=['(?P<answer>[0-9]+)']"


def _overrides(tiny_assets, tmp_path, ray_tmp, experiment, extra, steps=STEPS):
    return main_ppo_overrides(
        model_dir=tiny_assets.model_dir, train_file=tiny_assets.train_file, val_file=tiny_assets.test_file,
        reward_file=arith_reward.__file__, output_dir=tmp_path, ray_temp_dir=ray_tmp, adv_estimator="oar", steps=steps,
        train_batch_size=4, rollout_n=2, max_prompt_length=32, max_response_length=32, project="oar_e2e",
        experiment=experiment, extra=extra)


def _run(tiny_assets, tmp_path, experiment, extra, module="oar_verl.main", timeout_s=900, steps=STEPS):
    ray_tmp = new_ray_temp_dir()
    env = cpu_env(file_logger_root=tmp_path / "metrics")
    if FSDP1[0] in extra:  # torch refuses FSDP1's module-state sync for CPU tensors (gloo broadcasts them fine)
        env["VERL_USE_EXTERNAL_MODULES"] += ",devtools.fsdp1_cpu"
    try:
        extra = [LAST_NUMBER, *extra] if module == "oar_verl.main" else extra  # the OAR keys: OAR's config tree
        return run_main_ppo(_overrides(tiny_assets, tmp_path, ray_tmp, experiment, extra, steps), output_dir=tmp_path,
                            env=env, project="oar_e2e", experiment=experiment, timeout_s=timeout_s, module=module)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _check_oar_run(name, run, steps, dump_dir=None, dump_every=0):
    """The assertions every OAR run must pass, on its logged ``steps``."""
    print(f"{name}: rc={run.returncode} wall={run.wall_s:.0f}s peak tree RSS={run.peak_rss_gib} GiB "
          f"peak used-memory rise={run.peak_used_gib} GiB")
    for m in run.metrics:
        print({k: m.get(k) for k in ("step", "timing_s/step", "timing_s/old_log_prob", "timing_s/oar",
                                     "timing_s/oar_in_old_log_prob", "timing_s/oar_total", "actor/grad_norm",
                                     "oar/weight_std",
                                     "oar/ess_ratio", "oar/adv_mass_rel_err", "oar/passes_max", "oar/passes_min",
                                     "oar/answer_probe_frac")})
    assert run.returncode == 0, f"{name} failed (rc={run.returncode}); log tail:\n{run.log_tail()}"
    assert [m["step"] for m in run.metrics] == list(steps)
    for m in run.metrics:
        missing = [k for k in OAR_KEYS if k not in m]
        assert not missing, f"step {m['step']} lacks {missing}"
        assert m["timing_s/oar"] > 0
        # OAR's cost wherever it ran: the step's own part and the workers' inside verl's old-log-prob call (> 0
        # where the step's rows were read from that pass, 0 where the step's own call attributed), all of it inside
        # verl's old-log-prob timer
        inside = m["timing_s/oar_in_old_log_prob"]
        assert m["timing_s/oar_total"] == pytest.approx(m["timing_s/oar"] + inside, rel=1e-9)
        assert m["timing_s/oar_total"] <= m["timing_s/old_log_prob"], m
        if m.get("oar/shared_forward", -1.0) > 0:
            assert inside > 0, m
        elif m.get("oar/shared_forward", -1.0) == 0:
            assert inside == 0, m
        assert m["oar/adv_mass_rel_err"] < 1e-4, "reshaping changed a sequence's advantage mass"
    # at least one step reshaped tokens non-uniformly: the advantages differ from GRPO's token by token
    reshaped = [m for m in run.metrics if m["oar/reshaped_tokens"] > 0]
    assert reshaped, "no step had a sequence with a non-zero advantage to reshape"
    assert any(m["oar/weight_std"] > 1e-3 and m["oar/ess_ratio"] < 1.0 for m in reshaped)
    # and on every such step some row's scores had a spread (all flat: attribution read nothing, weights uniform)
    assert all(m["oar/flat_seq_frac"] < m["oar/reshaped_seq_frac"] for m in reshaped), \
        [(m["step"], m["oar/flat_seq_frac"], m["oar/reshaped_seq_frac"]) for m in reshaped]
    assert all(abs(m["oar/weight_mean"] - 1.0) < 1e-4 for m in reshaped)  # mean one over reasoning tokens
    assert all(m["oar/global_step"] == m["step"] for m in run.metrics)
    # attribution ran with exactly the weights of the step's old-log-prob pass (not reported in bypass mode, where
    # there is no such pass)
    assert all(m.get("oar/policy_matches_old_log_prob", 1.0) == 1.0 for m in run.metrics)
    grad_norms = [m.get("actor/grad_norm", 0.0) for m in run.metrics]
    assert any(g > 0 and math.isfinite(g) for g in grad_norms), grad_norms
    if dump_dir is not None:
        _check_dumps(run, dump_dir, dump_every)


@pytest.mark.e2e
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name,steps,extra", [
    # OAR-P on the V1 sync trainer in rollout-correction bypass mode, with the auto policy: rows with more than 4
    # reasoning tokens switch to hierarchical (segments of <= 4 tokens, exact OAR-P inside the top ones covering 30 %
    # of the row), shorter rows run exact; the actor on verl's FSDP1 engine, its default (the mask operator reads the
    # embedding table from FSDP1's root unit). (The V1 sync trainer outside bypass mode is the scale-settings run's.)
    ("oar_p_v1_bypass_auto", STEPS, ["algorithm.oar.mode=perturbation", "algorithm.oar.chunk_size=16",
                              "algorithm.oar.perturbation=auto", "algorithm.oar.exact_max_tokens=4",
                              "algorithm.oar.segment_min_tokens=1", "algorithm.oar.segment_max_tokens=4",
                              "algorithm.oar.refine_share=0.3", "algorithm.rollout_correction.bypass_mode=true",
                              "actor_rollout_ref.rollout.calculate_log_probs=true", *FSDP1]),
    # OAR-G on verl's colocate_async trainer, its clean teachers read from the old-log-prob forward and its noisy
    # passes right after it on the rows the step marked in TransferQueue (docs/method.md §14; fisher's and
    # conservative's scores read from it: the worker-group tests and auto_legacy's step 2), and the fidelity of its
    # attribution measured right after that pass on every step that attributed a row, and the token dump written
    # there (every step: a step's tool-calling rows may all tie, and then nothing is attributed, measured or dumped)
    # (docs/fidelity.md, "Logged while training"); the actor in
    # bf16 (verl's default), so that attribution with frozen parameters is the FSDP2 module's first forward and the
    # update after it must still get fp32 gradients
    # The rollout is verl's multi-turn agent loop (docs/multi_turn.md): a tiny model warm-started to call the
    # calculator (oar_verl.tools.calculator, a BaseTool through verl's hermes tool parser) and to state its result;
    # the tool's output sits inside each response with response_mask 0 (devtools/tool_assets.py)
    ("oar_g_colocate_async", STEPS, ["algorithm.oar.mode=gradient", "trainer.v1.trainer_mode=colocate_async",
                              "algorithm.oar.fidelity_every=1", "algorithm.oar.dump_every=1", BF16_ACTOR,
                              *MULTI_TURN]),
    # mode=auto (docs/auto.md) with its default candidates on the legacy trainer: conservative (auto_default) until
    # the first decision at step 1, the decision's mode after (step 2 read from the old-log-prob forward: both
    # candidates can), a re-check at step 3, the selector's state saved beside the step-3 checkpoint
    # the actor a LoRA adapter (PEFT, on every linear layer; vLLM serves it as an adapter): the rules and the shared
    # pass on the wrapped projections
    ("auto_legacy", STEPS, ["algorithm.oar.mode=auto", "trainer.use_v1=false", "algorithm.oar.auto_rows=2",
                     "algorithm.oar.auto_prompts=1", "algorithm.oar.auto_every=2", "algorithm.oar.auto_fallback=best",
                     "trainer.save_freq=3", *LORA]),
])
def test_oar_main_ppo_on_cpu(tiny_assets, tmp_path, request, name, steps, extra):
    dump_dir = tmp_path / "dumps"
    multi_turn = MULTI_TURN[0] in extra
    assets = tiny_assets
    if multi_turn:
        assets = request.getfixturevalue("tool_assets")
        extra = [*extra, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={assets.tool_config}"]
    every = 1 if "algorithm.oar.dump_every=1" in extra else 2  # every second step unless the run says every step
    dumps = [f"algorithm.oar.dump_every={every}"] if every == 2 else []
    run = _run(assets, tmp_path, name, [*dumps, *extra, f"algorithm.oar.dump_dir={dump_dir}"], steps=steps)
    _check_oar_run(name, run, range(1, steps + 1), dump_dir, every)
    if multi_turn:
        _check_multi_turn(run, dump_dir)
    reported = ["oar/policy_matches_old_log_prob" in m for m in run.metrics]
    assert not any(reported) if "bypass" in name else all(reported)
    perturbed = [m for m in run.metrics if "oar/perturbation_copies" in m]
    if "oar_p" in name:  # every step with OAR-P attribution reports what ran
        assert len(perturbed) == len([m for m in run.metrics if m["oar/attributed_seq_frac"] > 0])
    else:
        assert not perturbed
    fidelity = [m for m in run.metrics if "oar/fidelity/aopc" in m]
    attributed = [m for m in run.metrics if m["oar/attributed_seq_frac"] > 0]
    if "algorithm.oar.fidelity_every=1" in extra:  # every step that attributed measured its fidelity
        assert [m["step"] for m in fidelity] == [m["step"] for m in attributed]
        assert fidelity
        for m in fidelity:
            print({k: v for k, v in m.items() if "fidelity" in k})
            assert m["oar/fidelity/rows"] >= 1 and m["timing_s/oar_fidelity"] > 0
            # the controls: random, position and the policy's entropy from verl's old-log-prob pass
            assert all(math.isfinite(m[f"oar/fidelity/{k}"])
                       for k in ("aopc", "aopc_random", "gain", "gain_over_random", "gain_over_position", "rows_static",
                                 "gain_over_entropy", "aopc_entropy"))
            assert m["oar/fidelity/aopc"] >= 0 and "oar/fidelity/suppression" in m
    else:
        assert not fidelity and not any("timing_s/oar_fidelity" in m for m in run.metrics)
    shared = {m["step"]: m["oar/shared_forward"] for m in attributed}
    if "algorithm.oar.mode=gradient" in extra:  # its teachers read from the old-log-prob forward, fidelity step too
        assert set(shared.values()) == {1.0}, shared
        assert all(0.0 <= m["oar/recomputed_share"] <= 1.0 for m in attributed)  # the choice is logged
    elif "algorithm.oar.mode=auto" in extra:  # only the step that does not calibrate: its one mode can share
        assert shared == {1: 0.0, 2: 1.0, 3: 0.0}, shared
    else:
        assert set(shared.values()) <= {0.0}, shared
    if "algorithm.oar.mode=auto" in extra:  # the run chose its attribution, logged it and checkpointed it
        for m in run.metrics:
            print({k: v for k, v in m.items() if k.startswith("oar/auto/")})
            assert "oar/auto/calibrating" in m and "oar/auto/all/mode_index" in m
        assert run.metrics[-1]["oar/auto/all/decided"] == 1 and run.metrics[-1]["oar/auto/all/rows"] >= 2
        # every control, the policy's entropy (the legacy trainer hands verl's old-log-prob entropies over) included
        assert all(f"oar/auto/all/gain/conservative/{k}" in run.metrics[-1] for k in ("random", "position", "entropy"))
        assert sum(m["oar/auto/calibrating"] for m in run.metrics) >= 2  # calibration, then a re-check
        assert run.metrics[-1]["oar/auto/all/mode_index"] in (0.0, 1.0)  # fallback best: a candidate always runs
        state = json.loads((tmp_path / "checkpoints" / "global_step_3" / "oar_auto.json").read_text())
        assert state["bands"]["all"]["decided"] and state["candidates"] == ["conservative", "fisher"]
    if "auto" in name and "oar_p" in name:  # long rows were refined only in part: fewer copies than reasoning tokens
        assert any(0 < m["oar/refined_share"] < 1 for m in perturbed), [m.get("oar/refined_share") for m in perturbed]
        print({m["step"]: (m["oar/perturbation_copies"], m["oar/refined_share"]) for m in perturbed})


# 2 fake GPUs; the actor in bf16 (fp32 reductions) with gradient checkpointing and dynamic micro-batches of 120
# tokens, which attribution inherits as its budget (algorithm.oar.max_token_len_per_gpu is left unset): rows of
# 60-80 tokens need a pass each; a checkpoint every step, resumed automatically
# mode=auto on the V1 trainer: OAR-G (auto_default) at step 1 while it calibrates, the decision (fallback best: a
# candidate always runs) from step 2, no re-check within the run; the resumed launch keeps the decision from the
# checkpoint instead of calibrating again
AUTO = ["algorithm.oar.mode=auto", "algorithm.oar.auto_default=gradient", "algorithm.oar.auto_candidates=[gradient,fisher]",
        "algorithm.oar.auto_rows=2", "algorithm.oar.auto_prompts=1", "algorithm.oar.auto_every=100",
        "algorithm.oar.auto_fallback=best"]
SCALE = [*AUTO, "algorithm.oar.target=reference", "algorithm.oar.probe=auto",
         "algorithm.oar.probe_warmup_steps=2", "trainer.n_gpus_per_node=2", "++ray_kwargs.ray_init.num_gpus=2",
         "actor_rollout_ref.model.enable_gradient_checkpointing=True",
         BF16_ACTOR,
         "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=120",
         "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
         "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=120", "trainer.save_freq=1",
         "trainer.resume_mode=auto"]


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_oar_g_at_scale_settings_saves_and_resumes(tiny_assets, tmp_path):
    """Step 1, a checkpoint at step 1, then a second launch that resumes it and runs step 2: the global step, the
    probe warm-up schedule (LT-Logits for step 1, AS-Mean from step 2: the ground truth's span is always there with
    target=reference) and ``mode=auto``'s decision (OAR-G while it calibrates at step 1, the checkpoint's decision
    after) continue as in one run: a launch that started afresh would log step 1, probe with LT-Logits and calibrate
    again."""
    first = _run(tiny_assets, tmp_path, "oar_g_scale", [*SCALE, "trainer.total_training_steps=1"])
    _check_oar_run("oar_g_scale (step 1)", first, [1])
    assert (tmp_path / "checkpoints" / "global_step_1").is_dir()
    resumed = _run(tiny_assets, tmp_path, "oar_g_scale", [*SCALE, "trainer.total_training_steps=2"])
    _check_oar_run("oar_g_scale (resumed, step 2)", resumed, [2])
    probe = {m["step"]: m["oar/answer_probe_frac"] for m in first.metrics + resumed.metrics}
    assert probe == {1: 0.0, 2: 1.0}, probe
    # target=reference attributes rows ending in the ground truth: never read from the old-log-prob pass
    assert all(m["oar/shared_forward"] == 0 for m in first.metrics + resumed.metrics)
    # the budget needs several passes on every rank (ranks pad to the slowest; unequal counts are tested
    # deterministically by tests/integration/test_worker_group_on_cpu.py)
    assert all(m["oar/passes_min"] >= 2 for m in first.metrics + resumed.metrics)
    # mode=auto kept its decision across the resume: calibrated at step 1 only (and decided there, as checkpointed),
    # decided since, in the checkpoint's mode
    calibrating = {m["step"]: m["oar/auto/calibrating"] for m in first.metrics + resumed.metrics}
    assert calibrating == {1: 1.0, 2: 0.0}, calibrating
    state = json.loads((tmp_path / "checkpoints" / "global_step_1" / "oar_auto.json").read_text())
    assert state["bands"]["all"]["decided"] and state["candidates"] == ["gradient", "fisher"]
    assert all(m["oar/auto/all/decided"] == 1 for m in resumed.metrics)
    modes = {m["oar/auto/all/mode_index"] for m in resumed.metrics}
    assert modes == {float(state["candidates"].index(state["bands"]["all"]["mode"]))}, (modes, state["bands"])


def _check_multi_turn(run, dump_dir):
    """The multi-turn rollouts (docs/multi_turn.md): tool calls in the rows, the tool tokens' advantages verl's GRPO's
    bit for bit, no tool token weighted, the span on the model's own tokens, the mass kept on the model's tokens."""
    for m in run.metrics:
        print({k: v for k, v in m.items() if k.startswith(("oar/turns/", "num_turns/"))
               or k in ("oar/span_found_frac", "oar/no_reasoning_seq_frac", "oar/adv_mass_rel_err",
                        "critic/score/mean")})
        assert m["oar/turns/tool_rounds_per_row"] >= 0.5, m  # most rows called the tool
        assert m["num_turns/max"] >= 3  # user, assistant, tool, assistant
        assert m["oar/turns/context_adv_max_abs_diff"] == 0.0 and m["oar/turns/context_reshaped_tokens"] == 0.0
        assert m["oar/turns/answer_context_tokens"] == 0.0
        assert m["oar/adv_mass_rel_err"] <= 1e-6
    # every key on every step of a multi-turn run; the shares NaN on a step without a reshaped two-turn row
    assert all("oar/turns/share_last" in m and "oar/rewarded_without_span_frac" in m for m in run.metrics)
    shares = [m for m in run.metrics if not math.isnan(m["oar/turns/share_last"])]
    assert shares and all(0.0 <= m["oar/turns/share_last"] <= 1.0 for m in shares)
    assert any(m["oar/span_found_frac"] > 0 for m in run.metrics)
    # the dumped rows (the heatmap's input): tool outputs marked as context, never reasoning nor answer (the answer:
    # the last span among the model's own tokens)
    records = [json.loads(line) for p in dump_dir.glob("step_*.jsonl") for line in p.read_text().splitlines()]
    multi = [r for r in records if "turn" in r]
    assert multi, "no dumped row called the tool"
    for r in multi:
        assert all(not m for m, t in zip(r["reasoning"], r["turn"]) if t < 0)
        assert all(t >= 0 for a, t in zip(r["answer"], r["turn"]) if a)


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    """The multi-turn run's warm-started tool caller (devtools/tool_assets.py; ~1 min, cached by content)."""
    from devtools.tool_assets import build_tool_assets

    return build_tool_assets(tmp_path_factory.mktemp("tool_assets"))


def _check_dumps(run, dump_dir, every):
    """Token dumps for heatmaps: on the due steps (dump_every), each passed on to the next step that attributed a row
    where its own attributed none (a step whose groups all tied); whole prompt groups, per-token arrays aligned."""
    from oar_verl.core.dumps import DumpSchedule

    # (none of these runs has mode=auto's plain fallback, so a step's attributed rows are the estimator's)
    schedule = DumpSchedule(every, "algorithm.oar.dump_every")
    written = {m["step"]: d for m in run.metrics
               if (d := schedule.take(m["step"], m["oar/attributed_seq_frac"] > 0)) is not None}
    assert sorted(p.name for p in dump_dir.glob("*.jsonl")) == sorted(f"step_{s}.jsonl" for s in written)
    due = list(written)
    records = [json.loads(line) for s in due for line in (dump_dir / f"step_{s}.jsonl").read_text().splitlines()]
    assert all(r["step"] in due and r.get("due_step", r["step"]) == written[r["step"]] for r in records)
    assert all(any(r["step"] == s for r in records) for s in due)  # a written dump holds rows
    for r in records:
        n = len(r["tokens"])
        assert n and len(r["importance"]) == len(r["weight"]) == len(r["reasoning"]) == len(r["answer"]) == n
        reasoning_w = [w for w, m in zip(r["weight"], r["reasoning"]) if m]
        if r["advantage"] != 0 and reasoning_w:
            assert abs(sum(reasoning_w) - len(reasoning_w)) < 1e-3 * len(reasoning_w)
    assert all(len({r["uid"] for r in records if r["step"] == s}) <= 2 for s in due)


def _fails_fast(args, env_extra=None, timeout=300):
    env = {**os.environ, **cpu_env(), **(env_extra or {})}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


BAD_CONFIGURATIONS = [
    ("algorithm.oar.mode=sideways", "algorithm.oar.mode='sideways' is not allowed"),
    ("algorithm.oar.tau=1.5", "algorithm.oar.tau=1.5 is out of range"),
    ("actor_rollout_ref.model.use_fused_kernels=True",
     "actor_rollout_ref.model.use_fused_kernels=True: verl's fused forward returns log-probs without logits"),
    ("actor_rollout_ref.actor.strategy=dtensor_magic",
     "strategy='dtensor_magic' is not a registered actor strategy OAR can attribute with; registered: fsdp, fsdp2, megatron"),
    ("trainer.v1.trainer_mode=dreamy", "trainer.v1.trainer_mode='dreamy' has no OAR trainer; choose one of: sync"),
    ("trainer.use_v1=false algorithm.rollout_correction.bypass_mode=true",
     "algorithm.rollout_correction.bypass_mode=true with trainer.use_v1=false"),
    ("algorithm.oar.mode=perturbation algorithm.oar.mask=token",
     "algorithm.oar.mask=token needs algorithm.oar.mask_token_id"),
    # the tiny tokenizer's <|im_end|> (id 2): its eos and the chat template's end of turn
    ("algorithm.oar.mode=perturbation algorithm.oar.mask=token algorithm.oar.mask_token_id=2",
     "algorithm.oar.mask=token: the mask token 2 ('<|im_end|>', algorithm.oar.mask_token_id=2) is an end-of-sequence"),
]


@pytest.fixture(scope="module")
def bad_configuration_runs(tiny_assets, tmp_path_factory) -> dict[str, tuple[int, str, float]]:
    """(exit code, output, seconds) of ``python -m oar_verl.main`` under each of BAD_CONFIGURATIONS.

    The runs are independent driver start-ups (imports, then the config check), so they run two at a time: on 2 cores
    that halves the wall time of this group, which sits in the fast lane.
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(i_override):
        i, override = i_override
        tmp = tmp_path_factory.mktemp(f"bad{i}")
        return override, _fails_fast(["-m", "oar_verl.main", *_overrides(tiny_assets, tmp, tmp / "ray", "bad",
                                                                         override.split())])

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, enumerate(o for o, _ in BAD_CONFIGURATIONS)))


@pytest.mark.parametrize("override,message", BAD_CONFIGURATIONS)
def test_bad_configuration_fails_before_any_rollout(bad_configuration_runs, override, message):
    rc, out, seconds = bad_configuration_runs[override]
    assert rc != 0 and message in out, out[-3000:]
    assert "ray init kwargs" not in out  # validated in the driver, before Ray starts
    print(f"{override}: failed in {seconds:.1f} s")


@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_plain_verl_entry_with_oar_fails_fast_with_instructions(tiny_assets, tmp_path):
    """verl's own main_ppo cannot pass importance to an estimator: refuse at trainer construction, before rollout.
    "Before rollout" is asserted from the output (nothing generated), not by a clock: the driver's Ray and worker
    start-up took 267 s on a loaded machine and over 600 s under heavier load, so the subprocess limit is a hang
    guard."""
    ray_tmp = new_ray_temp_dir()
    try:
        rc, out, seconds = _fails_fast(["-m", "verl.trainer.main_ppo",
                                        *_overrides(tiny_assets, tmp_path, ray_tmp, "plain", [])], timeout=1200)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert rc != 0
    assert "python -m oar_verl.main" in out, out[-4000:]
    assert "timing_s/gen" not in out and "step:1" not in out  # nothing was generated
    print(f"plain main_ppo with adv_estimator=oar failed in {seconds:.0f} s")
