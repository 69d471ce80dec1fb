"""Jobs run with the .venv-openrlhf interpreter by tests/openrlhf/test_openrlhf.py (OpenRLHF 0.11.2 on CPU).

    python openrlhf_job.py advantages OUT_JSON MODEL_DIR          one process
    python -m torch.distributed.run --nproc_per_node 2 openrlhf_job.py zero OUT_DIR MODEL_DIR STAGE:MODE[,STAGE:MODE]
    python openrlhf_job.py train OUT_JSON MODEL_DIR WORK_DIR TRAINER STAGE MODE

``advantages``: OpenRLHF's real ``compute_advantages_and_returns`` (group_norm = GRPO, rloo) and replay buffer split,
then :func:`oar_verl.openrlhf.reshape.reshape_replay_buffer` on the items, against the core computed independently on
the original (prompt, response) rows. ``zero``: the same on 2 gloo ranks with unequal shards, the policy wrapped in
OpenRLHF's ``Actor`` inside a DeepSpeed ZeRO-``STAGE`` engine, then one policy-gradient update through the engine;
each ``STAGE:MODE`` in turn in the same two ranks (a fresh model and engine each, ``OUT_DIR/zeroSTAGE.json.rankR``).
``train``: OpenRLHF's whole ``train_ppo_ray`` through OAR's entry point on the CPU platform
(:mod:`devtools.openrlhf_platform`): 2 ZeRO ranks, one rollout engine, the sync or the async trainer, 2 steps; the
steps' scalars are read back from OpenRLHF's own TensorBoard log. Results are written as JSON (per rank for
``zero``); the pytest side asserts on them.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

# OpenRLHF's replay buffer asks for the current CUDA device at construction (it only builds a torch.device from it)
torch.cuda.current_device = lambda: 0

from oar_verl.core.methods.attribution import response_importance  # noqa: E402
from oar_verl.core.config import OARConfig  # noqa: E402
from oar_verl.core.reshaping.gating import oar_token_weights  # noqa: E402
from oar_verl.core.methods.gradient import sequence_seeds  # noqa: E402
from oar_verl.core.preprocess import pad_rows, row_fingerprints  # noqa: E402
from oar_verl.core.text.spans import locate_answer_spans  # noqa: E402
from oar_verl.openrlhf.reshape import reshape_replay_buffer  # noqa: E402

N_SAMPLES = 4
# (prompt, [(response, reward) x N_SAMPLES]) — the third group's rewards all agree: zero advantage, left alone
GROUPS = [
    ("What is 3 + 4?", [("3 plus 4 makes 7. The answer is 7.", 1.0), ("3 and 4 give 8. The answer is 8.", 0.0),
                        ("Adding 4 to 3 is 7. The answer is 7.", 1.0), ("I think it is 6. The answer is 6.", 0.0)]),
    ("What is 5 + 2?", [("5 plus 2 is 7. The answer is 7.", 1.0), ("5 and 2 make 9. The answer is 9.", 0.0),
                        ("Two more than 5 is 6. The answer is 6.", 0.0), ("It is 3. The answer is 3.", 0.0)]),
    ("What is 1 + 1?", [("1 plus 1 is 2. The answer is 2.", 1.0), ("One and one is 2. The answer is 2.", 1.0),
                        ("1 + 1 = 2. The answer is 2.", 1.0), ("Two. The answer is 2.", 1.0)]),
]


class _Args(Exception):
    def __init__(self, args):
        super().__init__("args")
        self.parsed = args


def openrlhf_args(argv: list[str]):
    """OpenRLHF's own parsed ``args`` (its ``train_ppo_ray`` parser and post-parse checks) for a command line."""
    import openrlhf.utils as orl_utils
    import ray

    def capture(args):
        raise _Args(args)

    saved = orl_utils.get_strategy, ray.is_initialized, sys.argv
    orl_utils.get_strategy, ray.is_initialized = capture, (lambda: True)
    sys.argv = ["train_ppo_ray", *argv]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    except _Args as e:
        return e.parsed
    finally:
        orl_utils.get_strategy, ray.is_initialized, sys.argv = saved
    raise RuntimeError("OpenRLHF's train_ppo_ray returned without building a strategy")


def tokenized_rows(tok):
    prompts, responses, rewards = [], [], []
    for q, samples in GROUPS:
        for text, r in samples:
            prompts.append(torch.tensor(tok.encode(q), dtype=torch.long))
            responses.append(torch.tensor(tok.encode(" " + text) + [tok.eos_token_id], dtype=torch.long))
            rewards.append(r)
    return prompts, responses, torch.tensor(rewards)


def experiences(prompts, responses, rewards, per_batch: int):
    """OpenRLHF Experiences as its samples generator makes them (sequences = prompt + response, action_mask shifted
    by one), ``per_batch`` samples each, with the rewards, an all-zero KL and the sample indices."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    out = []
    for s in range(0, len(prompts), per_batch):
        idx = list(range(s, min(s + per_batch, len(prompts))))
        seqs = [torch.cat([prompts[i], responses[i]]) for i in idx]
        L = max(len(x) for x in seqs)
        sequences = torch.zeros(len(idx), L, dtype=torch.long)
        attention = torch.zeros(len(idx), L, dtype=torch.long)
        action = torch.zeros(len(idx), L - 1, dtype=torch.bool)
        for j, i in enumerate(idx):
            n, p = len(seqs[j]), len(prompts[i])
            sequences[j, :n], attention[j, :n] = seqs[j], 1
            action[j, p - 1: n - 1] = True
        out.append(Experience(sequences=sequences, attention_mask=attention, action_mask=action,
                              kl=torch.zeros(len(idx), L - 1), rewards=rewards[idx].clone(), index=idx,
                              labels=["7"] * len(idx), response_length=action.sum(-1),
                              total_length=attention.sum(-1).float(), info={}))
    return out


def openrlhf_advantages(args, exps):
    """OpenRLHF's real RemoteExperienceMaker.compute_advantages_and_returns on ``exps`` (no model groups needed)."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy = SimpleNamespace(args=args)
    maker.args = args
    maker.advantage_estimator = args.algo.advantage.estimator
    maker.kl_ctl = FixedKLController(args.algo.kl.init_coef)
    return maker.compute_advantages_and_returns(exps)


def core_reference(model, tok, cfg, step, prompts, responses, seq_adv, rows):
    """(len(rows), T) w x A_seq by the core alone on the original rows (verl-style padded layout)."""
    pad = tok.pad_token_id
    p_ids, p_mask = pad_rows([prompts[i] for i in rows], pad, left=True)
    r_ids, r_mask = pad_rows([responses[i] for i in rows], pad, left=False)
    spans = locate_answer_spans(r_ids, r_mask, tok, cfg.answer_patterns)
    seeds = sequence_seeds(cfg.seed, step, row_fingerprints(p_ids, p_mask, r_ids, r_mask))
    model.eval()
    imp = response_importance(model, p_ids, p_mask, r_ids, r_mask, spans.reasoning_mask, spans.answer_mask, cfg,
                              global_step=step, mask_token_id=cfg.mask_token_id if cfg.mask_token_id is not None
                              else pad, seeds=seeds)
    tw = oar_token_weights(imp, spans.reasoning_mask, r_mask, cfg.tau, cfg.beta, cfg.floor, signed=cfg.signed_scores)
    return tw.weights.double() * seq_adv[rows][:, None], r_mask.bool()


def buffer_items(exps):
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

    buf = NaiveReplayBuffer(sample_batch_size=1, cpu_offload=False)
    for e in exps:
        buf.append(e)
    return buf.items


def compare(items, expected, ok_mask, rows, responses, tok):
    """max |Â_item − Â_core| over the rows' response tokens."""
    diff = 0.0
    for k, i in enumerate(rows):
        it = items[i]
        s = int(it.action_mask.nonzero()[0])
        n = len(responses[i])
        got = it.advantages[s: s + n].double()
        diff = max(diff, float((got - expected[k, :n]).abs().max()))
    return diff


def load(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return tok, model


BASE_ARGV = ["--actor.model_name_or_path", "x", "--rollout.n_samples_per_prompt", str(N_SAMPLES),
             "--algo.kl.init_coef", "0"]
CONFIGS = {
    "gradient": {"mode": "gradient", "probe": "as_mean", "noise_std": 0.01},
    "perturbation": {"mode": "perturbation", "probe": "as_mean"},
}


def job_advantages(out, model_dir):
    torch.manual_seed(0)
    tok, model = load(model_dir)
    prompts, responses, rewards = tokenized_rows(tok)
    res = {}
    for est in ("group_norm", "rloo"):
        args = openrlhf_args(BASE_ARGV + ["--algo.advantage.estimator", est])
        g = rewards.reshape(-1, N_SAMPLES)
        if est == "group_norm":
            want = ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-9)).reshape(-1)
        else:
            want = (g - (g.sum(-1, keepdim=True) - g) / (N_SAMPLES - 1)).reshape(-1)
        for mode, oar in CONFIGS.items():
            # fresh experiences per mode: the replay buffer's items start as views of them
            items = buffer_items(openrlhf_advantages(args, experiences(prompts, responses, rewards, per_batch=5)))
            # per-item sequence advantage as OpenRLHF computed it (constant over the action tokens)
            seq_adv = torch.stack([it.advantages[it.action_mask.bool()].double().mean() for it in items])
            const = max(float((it.advantages[it.action_mask.bool()].double() - seq_adv[i]).abs().max())
                        for i, it in enumerate(items))
            before = [it.advantages.clone() for it in items]
            received = [it.advantages for it in items]  # views into the experiences (as Ray's zero-copy ones are)
            cfg = OARConfig.from_mapping(oar)
            result = reshape_replay_buffer(items, model, tok, cfg, 3, max_tokens=64)
            untouched = all(torch.equal(t, b) for t, b in zip(received, before))
            rows = [i for i in range(len(items)) if float(seq_adv[i]) != 0.0]
            zero = [i for i in range(len(items)) if float(seq_adv[i]) == 0.0]
            expected, ok = core_reference(model, tok, cfg, 3, prompts, responses, seq_adv, rows)
            mass = [abs(float(items[i].advantages[items[i].action_mask.bool()].double().sum()
                              - before[i][items[i].action_mask.bool()].double().sum())) for i in rows]
            res[f"{est}/{mode}"] = {
                "seq_adv_vs_formula": float((seq_adv.float() - want).abs().max()),
                "advantage_constant_per_row": const,
                "max_abs_diff_vs_core": compare(items, expected, ok, rows, responses, tok),
                "mass_err_max": max(mass),
                "zero_rows": len(zero),
                "zero_rows_changed": sum(int(not torch.equal(items[i].advantages, before[i])) for i in zero),
                "received_tensors_untouched": untouched,
                "reshaped_rows": len(rows),
                "weights_not_uniform": float((result.weights.weights[result.weights.reshaped] - 1).abs().max()),
                "metrics": result.metrics,
            }
    res["entropies"] = entropy_check(model, buffer_items(experiences(prompts, responses, rewards, per_batch=5)))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def entropy_check(model, items) -> dict:
    """oar_verl.openrlhf.entropy.policy_entropies through OpenRLHF's own Actor on replay-buffer items, against the
    entropy of each response token's distribution computed directly from the model."""
    from openrlhf.models import Actor

    from oar_verl.openrlhf.entropy import policy_entropies

    actor = Actor(model)
    actor.packing_samples = False  # what OpenRLHF sets when it loads the model itself without --ds.packing_samples
    idx = [0, 3, len(items) - 1]
    got = policy_entropies(actor, items, "cpu")(idx)
    diff, lengths = 0.0, []
    with torch.no_grad():
        for i, e in zip(idx, got):
            seq = items[i].sequences.reshape(1, -1)
            logp = torch.log_softmax(model(seq, attention_mask=items[i].attention_mask.reshape(1, -1)).logits[0].double(),
                                     -1)
            start = int(items[i].action_mask.reshape(-1).nonzero()[0])
            n = int(items[i].action_mask.sum())
            want = -(logp.exp() * logp).sum(-1)[start: start + n]
            lengths.append([len(e), n])
            diff = max(diff, float((e[:n] - want).abs().max()))
    return {"max_abs_diff": diff, "lengths": lengths}


def job_zero(out_dir, model_dir, runs):
    """Each ``STAGE:MODE`` of ``runs`` (comma-separated) on the same 2 gloo ranks, one process group."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    for run in runs.split(","):
        stage, mode = run.split(":")
        zero_run(Path(out_dir) / f"zero{stage}.json", model_dir, int(stage), mode)
        dist.barrier()
    dist.destroy_process_group()


def zero_run(out, model_dir, stage, mode):
    import deepspeed
    import torch.distributed as dist
    from openrlhf.models import Actor

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tok, model = load(model_dir)
    reference = load(model_dir)[1]  # the same weights, plain: the core's reference
    prompts, responses, rewards = tokenized_rows(tok)
    args = openrlhf_args(BASE_ARGV + ["--algo.advantage.estimator", "group_norm"])
    exps = openrlhf_advantages(args, experiences(prompts, responses, rewards, per_batch=len(prompts)))
    items = buffer_items(exps)
    # unequal shards: rank 0 gets the two mixed-reward groups (8 rows to reshape), rank 1 the zero-advantage group
    # only (nothing of its own to attribute: it must still take part in every aligned pass, with a filler row)
    mine = list(range(0, 8)) if rank == 0 else [8, 9, 10, 11]
    items = [items[i] for i in mine]
    # fp32 (OpenRLHF loads from a path only in bf16/fp16): the instance path, which leaves packing_samples unset
    actor = Actor(model, attn_implementation="eager")
    actor.packing_samples = False
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
                 "zero_optimization": {"stage": stage}, "bf16": {"enabled": False}, "gradient_clipping": 1.0}
    optim = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    engine, optim, _, _ = deepspeed.initialize(model=actor.model, optimizer=optim, config=ds_config)
    actor.model = engine
    cfg = OARConfig.from_mapping(CONFIGS[mode])
    seq_adv_all = torch.stack([it.advantages[it.action_mask.bool()].double().mean() for it in items])
    before = [it.advantages.clone() for it in items]
    result = reshape_replay_buffer(items, engine.module, tok, cfg, 3, max_tokens=48)
    rows = [k for k in range(len(items)) if float(seq_adv_all[k]) != 0.0]
    glob = [mine[k] for k in rows]
    seq_adv = torch.zeros(len(prompts), dtype=torch.float64)
    seq_adv[glob] = seq_adv_all[rows]
    if glob:
        expected, ok = core_reference(reference, tok, cfg, 3, prompts, responses, seq_adv, glob)
    diff = 0.0
    for k, (i, g) in enumerate(zip(rows, glob)):
        it = items[i]
        s = int(it.action_mask.nonzero()[0])
        n = len(responses[g])
        diff = max(diff, float((it.advantages[s: s + n].double() - expected[k, :n]).abs().max()))
    zero_changed = sum(int(not torch.equal(items[k].advantages, before[k])) for k in range(len(items))
                       if float(seq_adv_all[k]) == 0.0)
    # one policy-gradient update through OpenRLHF's Actor and the ZeRO engine on the reshaped advantages
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch

    batch = make_experience_batch(items)
    engine.train()
    logp = actor(batch.sequences, batch.action_mask, batch.attention_mask)
    loss = -(batch.advantages * logp * batch.action_mask).sum() / batch.action_mask.sum()
    engine.backward(loss)
    engine.step()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"rank": rank, "world": world, "stage": stage, "rows": len(items), "reshaped": len(rows),
                   "max_abs_diff_vs_core": diff, "zero_rows_changed": zero_changed, "loss": float(loss),
                   "metrics": result.metrics}, f)


TRAIN_PROMPTS = 4


def train_argv(model_dir, work, trainer, stage, mode, extra=()):
    """``train_ppo_ray`` flags: 4 arithmetic prompts x 4 samples, 2 per rollout batch -> 2 global steps, 2 ZeRO ranks
    with micro-batches of 2 (the OAR token budget), 16 new tokens, the arithmetic reward as OpenRLHF's reward_func."""
    import random

    from oar_verl.quickstart import arith_reward
    from oar_verl.quickstart.tiny_assets import ANSWER_STYLES, make_arith_problem

    rng = random.Random(0)
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as f:
        for _ in range(TRAIN_PROMPTS):
            q, a = make_arith_problem(rng)
            f.write(json.dumps({"input": f"{q} {ANSWER_STYLES['sentence']}", "label": str(a)}) + "\n")
    oar = {"gradient": ["--oar.mode=gradient", "--oar.noise_std=0.01"], "perturbation": ["--oar.mode=perturbation"]}
    return [*oar[mode], *(["--train.async_enable"] if trainer == "async" else []),
            "--actor.model_name_or_path", model_dir, "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
            "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo", "--ds.zero_stage", str(stage),
            "--ds.attn_implementation", "eager", "--data.prompt_dataset", prompts, "--data.input_key", "input",
            "--data.label_key", "label", "--data.max_samples", str(TRAIN_PROMPTS), "--rollout.batch_size", "2",
            "--rollout.n_samples_per_prompt", str(N_SAMPLES), "--rollout.max_new_tokens", "16", "--data.max_len", "64",
            "--train.batch_size", "8", "--train.micro_batch_size", "2", "--rollout.micro_batch_size", "4",
            "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
            "--reward.remote_url", arith_reward.__file__, "--actor.adam.lr", "1e-3",
            "--ckpt.output_dir", os.path.join(work, "model_out"), "--ckpt.path", os.path.join(work, "ckpt"),
            "--ckpt.save_steps", "-1", "--logger.tensorboard_dir", os.path.join(work, "tb"), *extra]


def job_train(out, model_dir, work, trainer, stage, mode, extra="[]"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from devtools.openrlhf_platform import main

    main(train_argv(model_dir, work, trainer, int(stage), mode, json.loads(extra)))
    steps: dict[int, dict] = {}
    for run in os.listdir(os.path.join(work, "tb")):
        acc = EventAccumulator(os.path.join(work, "tb", run), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for ev in acc.Scalars(tag):
                steps.setdefault(ev.step, {})[tag.removeprefix("train/")] = ev.value
    with open(out, "w") as f:
        json.dump({"steps": {str(k): v for k, v in sorted(steps.items())}}, f, indent=1)


MISSED_SWAP = "--oar-test.missed-swap"  # job_cli: undo the actor swap after install (not an OAR flag)


def job_cli(out, cases_json):
    """The entry point's ``main`` (OpenRLHF's CLI module run unchanged, ``--oar.dry_run``) on each case's argv, in one
    process (OpenRLHF's imports cost most of the time): exit status and stderr per case."""
    import contextlib
    import io

    from oar_verl.openrlhf.train_ppo_ray import main

    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import ray

    import oar_verl.openrlhf.train_ppo_ray as entry

    plain, install = ppo_actor.PolicyModelActor, entry.install

    def install_then_miss(cfg, dry_run=False):
        """The swap made, then undone: as if OpenRLHF's CLI took its actor class from elsewhere."""
        install(cfg, dry_run=dry_run)
        ppo_actor.PolicyModelActor = plain

    res = []
    for argv in json.loads(cases_json):
        err, std = io.StringIO(), io.StringIO()
        code = 0
        missed = MISSED_SWAP in argv
        argv = [a for a in argv if a != MISSED_SWAP]
        entry.install = install_then_miss if missed else install
        initialized = ray.is_initialized
        if missed:  # no Ray cluster: the guard must refuse before any actor is created
            ray.is_initialized = lambda: True
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
            try:
                main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except Exception as e:  # noqa: BLE001 - reported per case, the test names it
                code, _ = 1, err.write(f"{type(e).__name__}: {e}")
            finally:
                ray.is_initialized = initialized
                ppo_actor.PolicyModelActor = plain
        res.append({"argv": argv, "code": code, "stderr": err.getvalue()[-3000:], "stdout": std.getvalue() if "--help" in argv else std.getvalue()[-3000:]})
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    kind = sys.argv[1]
    if kind == "advantages":
        job_advantages(sys.argv[2], sys.argv[3])
    elif kind == "cli":
        job_cli(sys.argv[2], sys.argv[3])
    elif kind == "train":
        job_train(*sys.argv[2:9])
    elif kind == "zero":
        job_zero(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(f"unknown job {kind!r}")
