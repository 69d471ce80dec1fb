#!/usr/bin/env bash
# Shared defaults of the GPU recipes (recipes/{gsm8k,math}/run_{grpo,oar_conservative,oar_g,oar_p}[_megatron].sh);
# sourced by them, never run.
#
# Every setting below is an environment variable with a default, so any recipe can be changed from the command line:
#   MODEL=qwen2.5-7b GPUS_PER_NODE=4 ROLLOUT_N=16 bash recipes/math/run_oar_g.sh trainer.total_training_steps=200
# ENGINE picks the actor engine: fsdp2 (default) or megatron (the run_*_megatron.sh scripts set it, with Qwen2.5-7B).
# Arguments after the script name are extra Hydra overrides, appended last (they win).
# DRY_RUN=1 prints the command (one shell-quoted argument per line) instead of running it.
# Paths go to Hydra unquoted (VAL_FILES may be a list [a,b]): keep spaces, commas and quotes out of them.
#
# The GRPO baseline and the OAR runs get every setting from here; a recipe adds only its estimator, so a comparison
# is fair. The loss set-up is the one OAR was published with (docs/method.md §6): seq-mean-token-mean aggregation, no KL
# loss, no KL in the reward, no entropy bonus, dual-clip off (clip_ratio_c=1e9).
# shellcheck disable=SC2034  # variables here are read by the recipes that source this file

RECIPES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(dirname "$RECIPES_DIR")

# --- model presets: MODEL picks the checkpoint and the model-size dependent defaults; MODEL_PATH may point anywhere
MODEL=${MODEL:-qwen2.5-1.5b}
case "$MODEL" in
  qwen2.5-1.5b)
    _model_path=Qwen/Qwen2.5-1.5B; _tp=1; _mcore_tp=1; _token_len=32768 ;;
  qwen2.5-7b)
    _model_path=Qwen/Qwen2.5-7B; _tp=2; _mcore_tp=2; _token_len=16384 ;;
  qwen2.5-1.5b-instruct)  # the tool recipes' (run_oar_tools*.sh): the chat template knows tools
    _model_path=Qwen/Qwen2.5-1.5B-Instruct; _tp=1; _mcore_tp=1; _token_len=32768 ;;
  qwen2.5-7b-instruct)
    _model_path=Qwen/Qwen2.5-7B-Instruct; _tp=2; _mcore_tp=2; _token_len=16384 ;;
  qwen2.5-math-7b)  # max_position_embeddings 4096: MAX_PROMPT_LEN + MAX_RESPONSE_LEN must stay <= 4096
    _model_path=Qwen/Qwen2.5-Math-7B; _tp=2; _mcore_tp=2; _token_len=16384 ;;
  *)
    echo "recipes: unknown MODEL=$MODEL (qwen2.5-1.5b | qwen2.5-7b | qwen2.5-math-7b | qwen2.5-1.5b-instruct |" \
         "qwen2.5-7b-instruct; MODEL_PATH overrides the path)" >&2
    exit 2 ;;
esac
MODEL_PATH=${MODEL_PATH:-$_model_path}

# --- cluster
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# --- data and lengths (the recipes set task-specific defaults of the lengths before sourcing this file)
DATA_DIR=${DATA_DIR:-$HOME/data/oar}          # python -m oar_verl.data.prepare {gsm8k,math,math500} --out $DATA_DIR/<name>
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-1024}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-2048}

# --- batch shape: TRAIN_BATCH_SIZE prompts x ROLLOUT_N responses per step; PPO_MINI_BATCH_SIZE prompts per update
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-64}
ROLLOUT_N=${ROLLOUT_N:-8}
PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-$_token_len}  # dynamic micro-batches: tokens per GPU pass

# --- optimisation
LR=${LR:-1e-6}
TOTAL_EPOCHS=${TOTAL_EPOCHS:-5}
TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-null}  # null: TOTAL_EPOCHS decides
LOSS_AGG_MODE=${LOSS_AGG_MODE:-seq-mean-token-mean}
CLIP_RATIO_C=${CLIP_RATIO_C:-1e9}                  # dual-clip off
PARAM_OFFLOAD=${PARAM_OFFLOAD:-False}
OPTIMIZER_OFFLOAD=${OPTIMIZER_OFFLOAD:-False}
# Liger kernels on the FSDP actor (actor_rollout_ref.model.use_liger; verl's default False; needs `pip install
# liger-kernel`, part of verl's [fsdp] extra). verl 0.9.1 reads the key only in its FSDP engine (it patches the Hugging
# Face modules); the Megatron engine builds Megatron-Core modules and ignores it, so ENGINE=megatron does not pass it.
# Same value for every algorithm, so the comparison stays fair (recipes/README.md, "Liger kernels").
USE_LIGER=${USE_LIGER:-False}

# --- actor engine
ENGINE=${ENGINE:-fsdp2}
case "$ENGINE" in
  fsdp2) _engine_suffix= ;;
  megatron) _engine_suffix=-megatron ;;
  *) echo "recipes: unknown ENGINE=$ENGINE (fsdp2 | megatron)" >&2; exit 2 ;;
esac
# Megatron layout (ENGINE=megatron). OAR attribution supports TP (with sequence parallelism), PP and DP; it refuses
# context parallelism, virtual pipeline stages, Megatron-FSDP and fused kernels at start-up, naming the key.
MEGATRON_TP=${MEGATRON_TP:-$_mcore_tp}
MEGATRON_PP=${MEGATRON_PP:-1}
MEGATRON_SP=${MEGATRON_SP:-True}                   # sequence parallelism (needs MEGATRON_TP > 1 to do anything)
MEGATRON_RECOMPUTE=${MEGATRON_RECOMPUTE:-full}     # full activation recompute (uniform, 1 layer) | none

# --- rollout (vLLM, hybrid engine: colocated with the actor, asleep while it trains)
ROLLOUT_TP=${ROLLOUT_TP:-$_tp}
ROLLOUT_GPU_MEM_UTIL=${ROLLOUT_GPU_MEM_UTIL:-0.6}
TEMPERATURE=${TEMPERATURE:-1.0}
VAL_N=${VAL_N:-1}                                  # >1: sampled validation with mean@N / best@N / maj@N
VAL_TEMPERATURE=${VAL_TEMPERATURE:-0}
VAL_DO_SAMPLE=${VAL_DO_SAMPLE:-False}

# --- OAR (ignored by the GRPO recipes). Attribution passes are packed by the actor's own token budget
# (PPO_MAX_TOKEN_LEN_PER_GPU, OAR-G under the actor's gradient checkpointing); OAR_MAX_TOKEN_LEN overrides it.
OAR_PRESET=${OAR_PRESET:-paper}                    # paper: tau=0.4 beta=2.0 | official_code: tau=0.25 beta=1.0
OAR_MAX_TOKEN_LEN=${OAR_MAX_TOKEN_LEN:-null}       # null: the actor's budget
OAR_DUMP_EVERY=${OAR_DUMP_EVERY:-10}               # token dumps for heatmaps every N steps (0 = off)

# --- logging, outputs
PROJECT=${PROJECT:-oar}
LOGGER=${LOGGER:-console,file}                     # add wandb / tensorboard / ...: LOGGER=console,file,wandb
TEST_FREQ=${TEST_FREQ:-10}
SAVE_FREQ=${SAVE_FREQ:--1}
EXPERIMENT=${EXPERIMENT:-${TASK:?recipes set TASK}-${ALGO:?recipes set ALGO}-${MODEL}${_engine_suffix}}
OUTPUT_DIR=${OUTPUT_DIR:-$REPO_DIR/outputs/$EXPERIMENT}
PYTHON=${PYTHON:-python3}
# verl's `file` logger writes $VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl (plot: python -m oar_verl.viz.curves)
export VERL_FILE_LOGGER_ROOT=${VERL_FILE_LOGGER_ROOT:-$OUTPUT_DIR/metrics}

# The OAR keys (appended by the OAR recipes after algorithm.adv_estimator=oar and algorithm.oar.mode=...).
oar_args() {
  OAR_ARGS=(
    algorithm.oar.preset="$OAR_PRESET"
    algorithm.oar.max_token_len_per_gpu="$OAR_MAX_TOKEN_LEN"
    algorithm.oar.dump_every="$OAR_DUMP_EVERY"
    algorithm.oar.dump_dir="$OUTPUT_DIR/oar_dumps"
  )
}

# The actor engine's keys: FSDP2, or Megatron (model_engine=megatron swaps verl's actor/ref config groups; the
# reference policy follows the actor's layout through verl's own interpolations).
engine_args() {
  if [[ "$ENGINE" == fsdp2 ]]; then
    ENGINE_ARGS=(
      actor_rollout_ref.model.use_remove_padding=True
      actor_rollout_ref.model.enable_gradient_checkpointing=True
      actor_rollout_ref.model.use_liger="$USE_LIGER"
      actor_rollout_ref.actor.strategy=fsdp2
      actor_rollout_ref.actor.fsdp_config.strategy=fsdp2
      actor_rollout_ref.actor.fsdp_config.param_offload="$PARAM_OFFLOAD"
      actor_rollout_ref.actor.fsdp_config.optimizer_offload="$OPTIMIZER_OFFLOAD"
    )
    return
  fi
  local mc=actor_rollout_ref.actor.megatron
  if [[ "${USE_LIGER,,}" != false && "$USE_LIGER" != 0 ]]; then
    echo "recipes: USE_LIGER=$USE_LIGER ignored with ENGINE=megatron (verl reads use_liger in its FSDP engine only)" >&2
  fi
  ENGINE_ARGS=(
    model_engine=megatron
    actor_rollout_ref.model.use_fused_kernels=False  # OAR reads its probe through verl's logits processor
    "$mc.tensor_model_parallel_size=$MEGATRON_TP"
    "$mc.pipeline_model_parallel_size=$MEGATRON_PP"
    "$mc.context_parallel_size=1"
    "$mc.virtual_pipeline_model_parallel_size=null"
    "$mc.sequence_parallel=$MEGATRON_SP"
    "$mc.use_distributed_optimizer=True"
    "$mc.use_remove_padding=True"
    "$mc.param_offload=$PARAM_OFFLOAD"
    "$mc.optimizer_offload=$OPTIMIZER_OFFLOAD"
  )
  if [[ "$MEGATRON_RECOMPUTE" == full ]]; then
    ENGINE_ARGS+=(
      "$mc.override_transformer_config.recompute_granularity=full"
      "$mc.override_transformer_config.recompute_method=uniform"
      "$mc.override_transformer_config.recompute_num_layers=1"
    )
  elif [[ "$MEGATRON_RECOMPUTE" != none ]]; then
    echo "recipes: unknown MEGATRON_RECOMPUTE=$MEGATRON_RECOMPUTE (full | none)" >&2
    exit 2
  fi
}

# launch OVERRIDE... : run `python -m oar_verl.main` with the shared settings, then the recipe's and the user's
# overrides. Reads TRAIN_FILES and VAL_FILES, which the recipes set after sourcing this file.
launch() {
  if [[ "$MODEL" == qwen2.5-math-7b ]] && (( MAX_PROMPT_LEN + MAX_RESPONSE_LEN > 4096 )); then
    echo "recipes: Qwen2.5-Math-7B has a 4096-token context; MAX_PROMPT_LEN + MAX_RESPONSE_LEN =" \
         "$(( MAX_PROMPT_LEN + MAX_RESPONSE_LEN ))" >&2
    exit 2
  fi
  engine_args
  local cmd=(
    "$PYTHON" -m oar_verl.main
    # data
    data.train_files="${TRAIN_FILES:?}"
    data.val_files="${VAL_FILES:?}"
    data.train_batch_size="$TRAIN_BATCH_SIZE"
    data.max_prompt_length="$MAX_PROMPT_LEN"
    data.max_response_length="$MAX_RESPONSE_LEN"
    data.filter_overlong_prompts=True
    data.truncation=error
    # reward: math-verify in a subprocess pool, strict GSM8K fast path
    reward.custom_reward_function.path=pkg://oar_verl.rewards.math_verify_reward
    reward.custom_reward_function.name=compute_score
    # model + actor: FSDP2 or Megatron, remove-padding, dynamic micro-batches, OAR's loss set-up
    actor_rollout_ref.model.path="$MODEL_PATH"
    "${ENGINE_ARGS[@]}"
    actor_rollout_ref.actor.optim.lr="$LR"
    actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE"
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
    actor_rollout_ref.actor.loss_agg_mode="$LOSS_AGG_MODE"
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.clip_ratio_c="$CLIP_RATIO_C"
    actor_rollout_ref.actor.calculate_entropy=True
    algorithm.use_kl_in_reward=False
    # rollout: vLLM hybrid engine
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n="$ROLLOUT_N"
    actor_rollout_ref.rollout.temperature="$TEMPERATURE"
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
    actor_rollout_ref.rollout.gpu_memory_utilization="$ROLLOUT_GPU_MEM_UTIL"
    actor_rollout_ref.rollout.max_num_batched_tokens="$(( MAX_PROMPT_LEN + MAX_RESPONSE_LEN > 8192 ? MAX_PROMPT_LEN + MAX_RESPONSE_LEN : 8192 ))"
    actor_rollout_ref.rollout.val_kwargs.n="$VAL_N"
    actor_rollout_ref.rollout.val_kwargs.temperature="$VAL_TEMPERATURE"
    actor_rollout_ref.rollout.val_kwargs.do_sample="$VAL_DO_SAMPLE"
    # trainer
    trainer.logger="[$LOGGER]"
    trainer.project_name="$PROJECT"
    trainer.experiment_name="$EXPERIMENT"
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node="$GPUS_PER_NODE"
    trainer.total_epochs="$TOTAL_EPOCHS"
    trainer.total_training_steps="$TOTAL_TRAINING_STEPS"
    trainer.test_freq="$TEST_FREQ"
    trainer.save_freq="$SAVE_FREQ"
    trainer.val_before_train=True
    trainer.default_local_dir="$OUTPUT_DIR/checkpoints"
    hydra.run.dir="$OUTPUT_DIR/hydra"
    "$@"
  )
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    local i last=$(( ${#cmd[@]} - 1 ))
    printf '%q %q %q \\\n' "${cmd[@]:0:3}"
    for (( i = 3; i <= last; i++ )); do
      if (( i < last )); then printf '  %q \\\n' "${cmd[i]}"; else printf '  %q\n' "${cmd[i]}"; fi
    done
    return 0
  fi
  mkdir -p "$OUTPUT_DIR"
  echo "[recipes] $EXPERIMENT: $MODEL_PATH ($ENGINE) on ${NNODES}x${GPUS_PER_NODE} GPUs -> $OUTPUT_DIR" >&2
  exec "${cmd[@]}"
}
