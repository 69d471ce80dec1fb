"""The GPU recipes, checked without a GPU: shell syntax, shellcheck, and a dry compose of their Hydra overrides.

Each recipe is run with ``DRY_RUN=1`` (it prints its command instead of launching), the overrides are composed against
the OAR config tree (``oar_verl/integration/config/oar_trainer.yaml`` on top of verl's ``ppo_trainer``) exactly as
``python -m oar_verl.main`` composes them, and the result goes through verl's own ``validate_config`` (actor dataclass
conversion, batch-size divisibility) and OAR's start-up validation. A renamed or misspelled key fails the compose.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "oar_verl" / "integration" / "config"
RECIPES = sorted((ROOT / "recipes").glob("*/run_*.sh"))
# GSM8K's multi-turn recipes with the calculator tool (docs/multi_turn.md), beside the single-turn algorithms
TOOL_RECIPES = {"recipes/gsm8k/run_oar_tools.sh", "recipes/gsm8k/run_oar_tools_megatron.sh"}
SHELL_SCRIPTS = [*RECIPES, ROOT / "recipes" / "common.sh", ROOT / "recipes" / "quickstart_cpu.sh"]
MODELS = ["qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-math-7b"]
MODEL_PATHS = {"qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B", "qwen2.5-7b": "Qwen/Qwen2.5-7B",
               "qwen2.5-math-7b": "Qwen/Qwen2.5-Math-7B"}
# each recipe's algorithm -> its algorithm.oar.mode (grpo: none); oar_conservative is the product's default mode
OAR_MODES = {"oar_conservative": "conservative", "oar_g": "gradient", "oar_p": "perturbation"}
ALGOS = ("grpo", *OAR_MODES)


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_expected_recipes_exist():
    assert {_id(p) for p in RECIPES} == {f"recipes/{t}/run_{a}{e}.sh" for t in ("gsm8k", "math")
                                          for a in ALGOS for e in ("", "_megatron")} | TOOL_RECIPES


def _recipe_kind(script: Path) -> tuple[str, str, bool]:
    """(task, algo, megatron) of a recipe path such as recipes/math/run_oar_g_megatron.sh."""
    stem = script.stem.removeprefix("run_")
    return script.parent.name, stem.removesuffix("_megatron"), stem.endswith("_megatron")


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_id)
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_id)
def test_shellcheck(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian: apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", "-x", str(script)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def dry_run(script: Path, *extra: str, **env: str) -> list[str]:
    """The recipe's Hydra overrides, from its ``DRY_RUN=1`` output (``python -m oar_verl.main`` stripped)."""
    full_env = {**os.environ, "DRY_RUN": "1", "DATA_DIR": "/data/oar", "OUTPUT_DIR": "/runs/out", **env}
    for key in ("MODEL", "MODEL_PATH", "EXPERIMENT", "TRAIN_BATCH_SIZE", "GPUS_PER_NODE"):
        if key not in env:
            full_env.pop(key, None)
    proc = subprocess.run(["bash", str(script), *extra], capture_output=True, text=True, env=full_env, cwd="/")
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout.replace("\\\n", " "))
    assert argv[1:3] == ["-m", "oar_verl.main"], argv[:3]
    return argv[3:]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(config_name="oar_trainer", overrides=overrides)


def validate(cfg) -> None:
    """What ``oar_verl.main`` checks in the driver before Ray starts."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from oar_verl.integration.guard import uses_oar
    from oar_verl.integration.startup import validate_oar_setup

    if uses_oar(cfg):
        validate_oar_setup(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("script", RECIPES, ids=_id)
def test_recipe_composes_and_validates(script, model):
    task, algo, megatron = _recipe_kind(script)
    cfg = compose(dry_run(script, MODEL=model))
    validate(cfg)
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    # OAR's loss set-up is the default of every recipe, baseline included
    assert actor.loss_agg_mode == "seq-mean-token-mean"
    assert actor.use_kl_loss is False and cfg.algorithm.use_kl_in_reward is False
    assert actor.entropy_coeff == 0 and actor.clip_ratio_c == 1e9
    # FSDP2 or Megatron actor + vLLM hybrid-engine rollout, math-verify reward
    assert actor.strategy == ("megatron" if megatron else "fsdp2")
    assert rollout.name == "vllm" and cfg.actor_rollout_ref.hybrid_engine is True
    assert cfg.reward.custom_reward_function.path == "pkg://oar_verl.rewards.math_verify_reward"
    assert cfg.actor_rollout_ref.model.path == MODEL_PATHS[model]
    assert cfg.trainer.experiment_name == f"{task}-{algo}-{model}" + ("-megatron" if megatron else "")
    if megatron:  # the layout OAR supports, mirrored by the reference policy through verl's interpolations
        tp = 1 if model == "qwen2.5-1.5b" else 2
        for role in (actor, cfg.actor_rollout_ref.ref):
            assert role.strategy == "megatron"
            mc = role.megatron
            assert (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size, mc.context_parallel_size) == \
                (tp, 1, 1)
        assert actor.megatron.sequence_parallel is True and actor.megatron.use_distributed_optimizer is True
        assert actor.megatron.override_transformer_config.recompute_granularity == "full"
        assert cfg.actor_rollout_ref.model.use_fused_kernels is False
    assert cfg.actor_rollout_ref.model.use_liger is False  # verl's default, USE_LIGER's too
    assert cfg.algorithm.adv_estimator == ("grpo" if algo == "grpo" else "oar")
    if algo != "grpo":
        assert cfg.algorithm.oar.mode == {**OAR_MODES, "oar_tools": "conservative"}[algo]
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable is (algo == "oar_tools")
    val_files = OmegaConf.to_container(cfg.data.val_files) if OmegaConf.is_list(cfg.data.val_files) \
        else [cfg.data.val_files]
    if task == "math":
        assert cfg.data.train_files == "/data/oar/math/train.parquet"
        assert val_files == ["/data/oar/math500/test.parquet", "/data/oar/gsm8k/test.parquet"]
        assert cfg.data.max_prompt_length + cfg.data.max_response_length <= 4096  # Qwen2.5-Math-7B's context
    elif algo == "oar_tools":
        assert cfg.data.train_files == "/data/oar/gsm8k_tools/train.parquet"
        assert val_files == ["/data/oar/gsm8k_tools/test.parquet"]
    else:
        assert val_files == ["/data/oar/gsm8k/test.parquet"]


@pytest.mark.parametrize("script", sorted(TOOL_RECIPES))
def test_tool_recipes_run_verl_s_agent_loop_with_the_calculator(script):
    """The multi-turn recipes (docs/multi_turn.md): Qwen2.5-Instruct by default (its chat template renders tools),
    verl's agent loop with the hermes parser, and a tool config verl itself loads into the calculator."""
    from verl.tools.tool_registry import initialize_tools_from_config

    from oar_verl.tools.calculator import CalculatorTool

    megatron = script.endswith("_megatron.sh")
    cfg = compose(dry_run(ROOT / script))
    validate(cfg)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable is True and mt.format == "hermes" and mt.max_assistant_turns == 4
    instruct = "Qwen/Qwen2.5-7B-Instruct" if megatron else "Qwen/Qwen2.5-1.5B-Instruct"
    assert cfg.actor_rollout_ref.model.path == instruct
    assert cfg.actor_rollout_ref.actor.strategy == ("megatron" if megatron else "fsdp2")
    assert mt.tool_config_path == str(ROOT / "recipes" / "tools" / "calculator.yaml")
    assert cfg.reward.custom_reward_function.reward_kwargs.gsm8k_fallback is False  # tool rows: strict `#### N` only
    assert list(cfg.algorithm.oar.answer_patterns) == ["gsm8k"]  # OAR's span: the number the reward pays for
    tools = initialize_tools_from_config(mt.tool_config_path)
    assert [type(t) for t in tools] == [CalculatorTool] and tools[0].name == "calc"
    # the data the recipe reads: python -m oar_verl.data.prepare gsm8k --tools
    from oar_verl.data.prepare import TOOL_AGENT, to_verl_rows

    rows, _ = to_verl_rows("gsm8k", [{"question": "1 + 2?", "answer": "3\n#### 3"}], "train", tools=True)
    assert rows[0]["agent_name"] == TOOL_AGENT == "tool_agent" and "calc" in rows[0]["prompt"][0]["content"]
    twin = dry_run(ROOT / "recipes" / "gsm8k" / "run_oar_tools_megatron.sh")
    assert twin == dry_run(ROOT / "recipes" / "gsm8k" / "run_oar_tools.sh", ENGINE="megatron",
                           MODEL="qwen2.5-7b-instruct")


def test_calculator_tool():
    import asyncio

    from oar_verl.tools.calculator import CalculatorTool, evaluate

    assert [evaluate(e) for e in ("23+45", "7/2", "(12*3)//5", "1,000 + 2", "2**3")] == ["68", "3.5", "7", "1002", "8"]
    assert all(evaluate(e).startswith("error:") for e in ("__import__('os')", "1/0", "2**999", "x+1", "9" * 300))
    tool = CalculatorTool({"type": "native"})
    assert asyncio.run(tool.execute("i", {"expr": "3*4"}))[0].text == "12"
    assert asyncio.run(tool.execute("i", {"wrong": 1}))[0].text.startswith("error:")


def _leaves(cfg) -> dict[str, object]:
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return flat


@pytest.mark.parametrize("engine", ["", "_megatron"], ids=["fsdp2", "megatron"])
@pytest.mark.parametrize("task", ["gsm8k", "math"])
def test_baseline_and_oar_runs_differ_only_in_the_estimator(task, engine):
    configs = {algo: _leaves(compose(dry_run(ROOT / "recipes" / task / f"run_{algo}{engine}.sh", EXPERIMENT="x",
                                              OUTPUT_DIR="/runs/x")))
               for algo in ALGOS}
    base = configs["grpo"]
    for algo in OAR_MODES:
        differing = {k for k in base.keys() | configs[algo].keys() if base.get(k) != configs[algo].get(k)}
        unexpected = {k for k in differing if k != "algorithm.adv_estimator" and not k.startswith("algorithm.oar.")}
        assert not unexpected, f"{task}: grpo and {algo} differ in {sorted(unexpected)}"


@pytest.mark.parametrize("task", ["gsm8k", "math"])
def test_liger_reaches_every_fsdp_recipe_alike(task):
    """USE_LIGER=True (verl's actor_rollout_ref.model.use_liger, a key of its config tree) reaches the composed config
    of every FSDP recipe, which still differ in nothing but the estimator."""
    configs = {}
    for algo in ALGOS:
        cfg = compose(dry_run(ROOT / "recipes" / task / f"run_{algo}.sh", EXPERIMENT="x", OUTPUT_DIR="/runs/x",
                              USE_LIGER="True"))
        validate(cfg)
        assert cfg.actor_rollout_ref.model.use_liger is True, algo
        configs[algo] = _leaves(cfg)
    base = configs["grpo"]
    for algo in OAR_MODES:
        differing = {k for k in base.keys() | configs[algo].keys() if base.get(k) != configs[algo].get(k)}
        assert all(k == "algorithm.adv_estimator" or k.startswith("algorithm.oar.") for k in differing), algo


@pytest.mark.parametrize("task", ["gsm8k", "math"])
def test_liger_is_not_passed_to_megatron(task):
    """verl 0.9.1 reads use_liger in its FSDP engine only (it patches Hugging Face modules; Megatron builds its own):
    the Megatron recipes leave the key at verl's default and say that USE_LIGER is ignored."""
    script = ROOT / "recipes" / task / "run_oar_conservative_megatron.sh"
    overrides = dry_run(script, USE_LIGER="True")
    assert not any(o.startswith("actor_rollout_ref.model.use_liger=") for o in overrides)
    cfg = compose(overrides)
    validate(cfg)
    assert cfg.actor_rollout_ref.model.use_liger is False
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          env={**os.environ, "DRY_RUN": "1", "USE_LIGER": "True"})
    assert proc.returncode == 0 and "USE_LIGER=True ignored with ENGINE=megatron" in proc.stderr


@pytest.mark.parametrize("task", ["gsm8k", "math"])
def test_the_default_mode_recipe_runs_the_default_mode_and_names_it(task):
    """run_oar_conservative.sh runs OARConfig's default mode and passes it explicitly, so the command shows it."""
    from oar_verl.core import OARConfig

    for engine in ("", "_megatron"):
        overrides = dry_run(ROOT / "recipes" / task / f"run_oar_conservative{engine}.sh")
        assert "algorithm.oar.mode=conservative" in overrides
        cfg = compose(overrides)
        assert cfg.algorithm.adv_estimator == "oar"
        assert cfg.algorithm.oar.mode == "conservative" == OARConfig().mode


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("task", ["gsm8k", "math"])
def test_megatron_twin_is_the_fsdp_recipe_with_engine_megatron(task, algo):
    """run_X_megatron.sh is run_X.sh with ENGINE=megatron and Qwen2.5-7B by default, nothing else."""
    twin = dry_run(ROOT / "recipes" / task / f"run_{algo}_megatron.sh")
    assert twin == dry_run(ROOT / "recipes" / task / f"run_{algo}.sh", ENGINE="megatron", MODEL="qwen2.5-7b")


def test_environment_variables_override_defaults():
    cfg = compose(dry_run(ROOT / "recipes" / "gsm8k" / "run_oar_p.sh", GPUS_PER_NODE="4", NNODES="2",
                          TRAIN_BATCH_SIZE="64", ROLLOUT_N="16", MAX_RESPONSE_LEN="512", LOGGER="console,wandb",
                          MODEL_PATH="/models/my-qwen", OAR_MAX_TOKEN_LEN="8192"))
    validate(cfg)
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes, cfg.data.train_batch_size) == (4, 2, 64)
    assert cfg.actor_rollout_ref.rollout.n == 16 and cfg.data.max_response_length == 512
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.actor_rollout_ref.model.path == "/models/my-qwen" and cfg.algorithm.oar.max_token_len_per_gpu == 8192


def test_extra_arguments_are_hydra_overrides_that_win():
    cfg = compose(dry_run(ROOT / "recipes" / "math" / "run_oar_g.sh", "trainer.total_training_steps=7",
                          "algorithm.oar.tau=0.3"))
    assert cfg.trainer.total_training_steps == 7 and cfg.algorithm.oar.tau == 0.3


@pytest.mark.parametrize("bad", ["actor_rollout_ref.actor.loss_agg_modee=token-mean", "algorithm.oar.modee=gradient",
                                 "trainer.n_gpu_per_node=8"])
def test_misspelled_key_fails_the_compose(bad):
    from hydra.errors import ConfigCompositionException

    overrides = dry_run(ROOT / "recipes" / "gsm8k" / "run_oar_g.sh", bad)
    with pytest.raises(ConfigCompositionException, match="Could not override"):
        compose(overrides)


def test_megatron_layout_from_the_environment():
    cfg = compose(dry_run(ROOT / "recipes" / "math" / "run_oar_g_megatron.sh", MEGATRON_TP="4", MEGATRON_PP="2",
                          MEGATRON_RECOMPUTE="none"))
    validate(cfg)
    mc = cfg.actor_rollout_ref.actor.megatron
    assert (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size) == (4, 2)
    assert mc.override_transformer_config.recompute_granularity is None


def test_megatron_layout_oar_cannot_run_is_refused_before_start():
    """Context parallelism is not supported by OAR's attribution: the driver refuses it, naming the key."""
    from oar_verl.integration.estimator import OARSetupError

    cfg = compose(dry_run(ROOT / "recipes" / "gsm8k" / "run_oar_p_megatron.sh",
                          "actor_rollout_ref.actor.megatron.context_parallel_size=2"))
    with pytest.raises(OARSetupError, match="actor_rollout_ref.actor.megatron.context_parallel_size=2"):
        validate(cfg)


@pytest.mark.parametrize(("script", "var"), [("run_grpo.sh", "ENGINE=deepspeed"),
                                             ("run_grpo_megatron.sh", "MEGATRON_RECOMPUTE=selective")])
def test_unknown_engine_settings_are_refused(script, var):
    key, value = var.split("=")
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "gsm8k" / script)], capture_output=True, text=True,
                          env={**os.environ, "DRY_RUN": "1", key: value})
    assert proc.returncode == 2 and f"unknown {var}" in proc.stderr


def test_unknown_model_preset_is_refused():
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "gsm8k" / "run_grpo.sh")], capture_output=True, text=True,
                          env={**os.environ, "DRY_RUN": "1", "MODEL": "llama-7b"})
    assert proc.returncode == 2 and "unknown MODEL=llama-7b" in proc.stderr


# --- the OpenRLHF recipes (recipes/openrlhf/): bash -n, shellcheck, and OpenRLHF 0.11.2's own argument parser in the
# .venv-openrlhf environment (the OAR entry point's --oar.dry_run: OpenRLHF's CLI module parses and checks the flags,
# then OAR's start-up checks run; no Ray, no model)
OPENRLHF_RECIPES = sorted((ROOT / "recipes" / "openrlhf").glob("*/run_*.sh"))
OPENRLHF_SHELL = [*OPENRLHF_RECIPES, ROOT / "recipes" / "openrlhf" / "common.sh"]
OPENRLHF_PYTHON = Path(os.environ.get("OAR_OPENRLHF_VENV", ROOT / ".venv-openrlhf")) / "bin" / "python"


def test_openrlhf_recipes_exist():
    assert {_id(p) for p in OPENRLHF_RECIPES} == {f"recipes/openrlhf/{t}/run_{a}.sh" for t in ("gsm8k", "math")
                                                   for a in ("grpo", "oar_g", "oar_p")}


@pytest.mark.parametrize("script", OPENRLHF_SHELL, ids=_id)
def test_openrlhf_recipe_shell(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian: apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", "-x", str(script)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def openrlhf_command(script: Path, **env: str) -> list[str]:
    """The recipe's ``python -m MODULE ARGS...`` from its ``DRY_RUN=1`` output."""
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          env={**os.environ, "DRY_RUN": "1", "DATA_DIR": "/data/oar", **env})
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line)[0] for line in proc.stdout.splitlines()]


def test_openrlhf_recipes_differ_only_in_oar_flags():
    for task in ("gsm8k", "math"):
        cmds = {a: openrlhf_command(ROOT / "recipes" / "openrlhf" / task / f"run_{a}.sh", OUTPUT_DIR="/runs/out")
                for a in ("grpo", "oar_g", "oar_p")}
        assert cmds["grpo"][:3] == ["python", "-m", "openrlhf.cli.train_ppo_ray"]
        for algo in ("oar_g", "oar_p"):
            assert cmds[algo][:3] == ["python", "-m", "oar_verl.openrlhf.train_ppo_ray"]
            assert [a for a in cmds[algo][3:] if not a.startswith("--oar.")] == cmds["grpo"][3:], algo
        assert "--oar.mode=gradient" in cmds["oar_g"] and "--oar.mode=perturbation" in cmds["oar_p"]


@pytest.mark.skipif(os.environ.get("OAR_SKIP_OPENRLHF", "0") == "1" or not OPENRLHF_PYTHON.exists(),
                    reason="no OpenRLHF environment (OAR_SKIP_OPENRLHF=1, or build it with "
                           "`bash scripts/setup_openrlhf_env.sh`)")
def test_openrlhf_recipes_pass_openrlhf_parser(tmp_path):
    """Every recipe x model through OpenRLHF's own parser and OAR's start-up checks, in one process."""
    import json

    cases = [openrlhf_command(s, MODEL=m)[3:] + ["--oar.dry_run"]
             for s in OPENRLHF_RECIPES for m in ("qwen2.5-1.5b", "qwen2.5-7b")]
    out = tmp_path / "cli.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([str(OPENRLHF_PYTHON), str(ROOT / "tests" / "openrlhf" / "openrlhf_job.py"), "cli", str(out),
                           json.dumps(cases)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for case, r in zip(cases, json.loads(out.read_text())):
        assert r["code"] == 0 and "arguments accepted with OAR" in r["stdout"], (case, r)


def test_the_quickstart_recipe_runs_the_module_the_wheel_test_runs():
    """The README's first command is set-up plus ``python -m oar_verl.quickstart``, the module
    tests/e2e/test_quickstart_on_cpu.py runs from the wheel (so the two cannot drift)."""
    script = (ROOT / "recipes" / "quickstart_cpu.sh").read_text()
    assert 'bash "$ROOT/scripts/setup_env.sh"' in script
    assert script.rstrip().endswith('exec "$VENV/bin/python" -m oar_verl.quickstart "$@"')
