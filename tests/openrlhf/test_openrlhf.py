"""OAR on OpenRLHF 0.11.2's real classes on CPU, in the separate ``.venv-openrlhf`` environment.

``bash scripts/setup_openrlhf_env.sh`` builds it (``scripts/test.sh`` does unless ``OAR_SKIP_OPENRLHF=1``);
``OAR_OPENRLHF_VENV`` points elsewhere. The jobs (``openrlhf_job.py``) run OpenRLHF's own argument parser, its
``compute_advantages_and_returns`` (group_norm = GRPO, rloo) and replay-buffer split, then the adapter's
:func:`oar_verl.openrlhf.reshape.reshape_replay_buffer`, and compare the reshaped advantages with the core computed
independently on the original rows; under DeepSpeed ZeRO-2 and ZeRO-3 on 2 gloo ranks with unequal shards (one rank
with nothing of its own to attribute), followed by one update through the engine. The entry point's start-up
refusals run through OpenRLHF's own CLI module with ``--oar.dry_run``. Last, OpenRLHF's whole ``train_ppo_ray`` loop
runs through the entry point on the CPU platform (:mod:`oar_verl.cpu.openrlhf_platform`), sync and async.
"""

from __future__ import annotations

import json
import math
import os
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


def _run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random fp32 Qwen2 checkpoint with the arithmetic BPE tokenizer, built by the OpenRLHF environment."""
    d = tmp_path_factory.mktemp("openrlhf") / "model"
    _run([str(PYTHON), "-c", "import sys; from oar_verl.cpu.tiny_assets import build_tokenizer, build_tiny_qwen2; "
          "tok = build_tokenizer(sys.argv[1], seed=0); build_tiny_qwen2(sys.argv[1], tok, seed=0)", str(d)])
    return d


def test_advantages_and_reshape_match_core(model_dir, tmp_path):
    out = tmp_path / "adv.json"
    _run([str(PYTHON), str(JOB), "advantages", str(out), str(model_dir)])
    res = json.loads(out.read_text())
    assert set(res) == {f"{e}/{m}" for e in ("group_norm", "rloo") for m in ("gradient", "perturbation")}
    for name, r in res.items():
        assert r["seq_adv_vs_formula"] < 1e-6, name  # OpenRLHF's own estimator, as its formula says
        assert r["advantage_constant_per_row"] < 1e-6, name  # an outcome advantage: one value per sequence
        assert r["reshaped_rows"] == 8 and r["zero_rows"] == 4, name
        assert r["max_abs_diff_vs_core"] < TOL, name
        assert r["mass_err_max"] < 1e-5, name  # Σ_t Â_t = n·A_seq on every reshaped row
        assert r["zero_rows_changed"] == 0, name  # the all-agree group keeps its (zero) advantages untouched
        assert r["weights_not_uniform"] > 0.1, name  # OAR actually moved credit
        assert r["metrics"]["oar/reshaped_seq_frac"] == pytest.approx(8 / 12)


@pytest.mark.parametrize("stage,mode", [(2, "gradient"), (3, "perturbation")])
def test_zero_two_ranks_unequal_shards(model_dir, tmp_path, stage, mode):
    out = tmp_path / f"zero{stage}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _run([str(PYTHON), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(port), str(JOB), "zero", str(out), str(model_dir), str(stage), mode])
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
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
]
ACCEPTED = ["--oar.mode=perturbation", "--oar.perturbation", "auto", "--algo.advantage.estimator", "group_norm",
            "--algo.kl.use_loss"]


def test_entry_point_refuses_at_start_up(tmp_path):
    """Each refused setting exits 2 naming the flag, before Ray or a model starts; GRPO with the KL as a loss passes."""
    out = tmp_path / "cli.json"
    cases = [BASE + flags for flags, _ in REFUSED] + [BASE + ACCEPTED]
    _run([str(PYTHON), str(JOB), "cli", str(out), json.dumps(cases)])
    res = json.loads(out.read_text())
    for (flags, named), r in zip(REFUSED, res):
        assert r["code"] == 2 and named in r["stderr"], (flags, r)
    assert res[-1]["code"] == 0 and "arguments accepted with OAR (perturbation)" in res[-1]["stdout"], res[-1]


# ZeRO-2 for both: under bf16 ZeRO-3 on CPU/gloo (the only precision OpenRLHF loads a path in), DeepSpeed now and then
# hands the first forward a NaN in a gathered parameter before any OAR code runs (docs/openrlhf.md); ZeRO-3 with OAR-P
# is covered in fp32 by test_zero_two_ranks_unequal_shards
@pytest.mark.parametrize("trainer,stage,mode", [("sync", 2, "perturbation"), ("async", 2, "gradient")])
def test_train_ppo_ray_loop_on_cpu(model_dir, tmp_path, trainer, stage, mode):
    """``python -m oar_verl.openrlhf.train_ppo_ray`` as a user runs it, on the CPU platform: OpenRLHF's parser, Ray
    actor groups (2 ZeRO ranks), its sync or async trainer, rollouts from OpenRLHF's rollout actor with Hugging Face
    generate in place of vLLM, its experience maker and reward function, OAR in the actor's ``fit``, the PPO update,
    the weight sync to the rollout engine, the TensorBoard log and the saved model: 2 global steps."""
    from safetensors.torch import load_file

    out, work = tmp_path / "train.json", tmp_path / "work"
    work.mkdir()
    proc = _run([str(PYTHON), str(JOB), "train", str(out), str(model_dir), str(work), trainer, str(stage), mode],
                timeout=900)
    steps = json.loads(out.read_text())["steps"]
    assert sorted(steps) == ["1", "2"], steps
    for step, m in steps.items():
        # OAR ran in the actor's fit and its metrics reached OpenRLHF's logged status
        assert m["oar/global_step"] == int(step)
        assert m["oar/reshaped_seq_frac"] > 0 and m["oar/reshaped_tokens"] > 0, m
        assert m["oar/adv_mass_rel_err"] < 1e-6 and m["oar/weight_mean"] == pytest.approx(1.0, abs=1e-5), m
        assert m["oar/weight_std"] > 0.05, m  # credit actually moved between tokens
        assert m["timing/oar"] > 0 and math.isfinite(m["actor_grad_norm"]) and m["actor_grad_norm"] > 0, m
        assert m["rollout/num_samples"] == 8 and m["rollout/response_length_mean"] > 0, m
    # the actor's weights reached the rollout engine after each step (through Ray, in place of NCCL)
    logs = proc.stdout + proc.stderr
    for k in (1, 2):
        assert f"rollout engine: weights from the actor, update {k}" in logs, logs[-3000:]
    # the trained model was saved, and the updates changed it
    before, after = load_file(model_dir / "model.safetensors"), load_file(work / "model_out" / "model.safetensors")
    shared = set(after) & set(before)  # OpenRLHF also writes the tied lm_head the tiny checkpoint leaves out
    assert "model.embed_tokens.weight" in shared
    assert any(not torch.allclose(after[k].float(), before[k].float()) for k in shared)
