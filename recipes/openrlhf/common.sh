#!/usr/bin/env bash
# Shared defaults of the OpenRLHF recipes (recipes/openrlhf/{gsm8k,math}/run_{grpo,oar_g,oar_p}.sh); sourced, never run.
#
# OpenRLHF 0.11.2 on GPUs, through python -m oar_verl.openrlhf.train_ppo_ray (OpenRLHF's own CLI, its flags unchanged,
# plus --oar.* flags). The GRPO baseline (plain openrlhf.cli.train_ppo_ray) and the OAR runs take every setting from
# here and differ only in the OAR flags.
#   MODEL=qwen2.5-7b GPUS_PER_NODE=8 ROLLOUT_N=8 bash recipes/openrlhf/math/run_oar_g.sh --train.num_episodes 2
# Arguments after the script name are extra OpenRLHF/--oar flags, appended last (argparse: the last one wins).
# DRY_RUN=1 prints the command (one shell-quoted argument per line) instead of running it.
# GRPO here = --algo.advantage.estimator group_norm with the KL as a loss term (OAR refuses a KL folded into the
# per-token rewards, OpenRLHF's default); data: JSONL with "prompt" (chat messages or text) and "label" (the answer),
# scored by a reward function (REWARD_FUNC, a Python file OpenRLHF loads with --reward.remote_url).
# shellcheck disable=SC2034  # variables here are read by the recipes that source this file

MODEL=${MODEL:-qwen2.5-1.5b}
case "$MODEL" in
  qwen2.5-1.5b) _model_path=Qwen/Qwen2.5-1.5B; _zero=2; _vllm_tp=1 ;;
  qwen2.5-7b)   _model_path=Qwen/Qwen2.5-7B; _zero=3; _vllm_tp=2 ;;
  *)
    echo "recipes/openrlhf: unknown MODEL=$MODEL (qwen2.5-1.5b | qwen2.5-7b; MODEL_PATH overrides the path)" >&2
    exit 2 ;;
esac
MODEL_PATH=${MODEL_PATH:-$_model_path}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
VLLM_TP=${VLLM_TP:-$_vllm_tp}
VLLM_ENGINES=${VLLM_ENGINES:-$((NNODES * GPUS_PER_NODE / VLLM_TP))}
ZERO_STAGE=${ZERO_STAGE:-$_zero}
DATA_DIR=${DATA_DIR:-$HOME/data/oar-openrlhf}
REWARD_FUNC=${REWARD_FUNC:-$DATA_DIR/reward_func.py}
OUTPUT_DIR=${OUTPUT_DIR:-$HOME/runs/openrlhf-$TASK-$ALGO-$MODEL}
ROLLOUT_N=${ROLLOUT_N:-8}
ROLLOUT_BATCH=${ROLLOUT_BATCH:-128}
TRAIN_BATCH=${TRAIN_BATCH:-$((ROLLOUT_BATCH * ROLLOUT_N / 4))}
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-1024}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-2048}
LR=${LR:-1e-6}
EPISODES=${EPISODES:-1}

# OpenRLHF's flags shared by every algorithm of a task
openrlhf_args() {
  ARGS=(
    --actor.model_name_or_path "$MODEL_PATH"
    --actor.num_nodes "$NNODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
    --ref.num_nodes "$NNODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
    --vllm.num_engines "$VLLM_ENGINES" --vllm.tensor_parallel_size "$VLLM_TP" --vllm.gpu_memory_utilization 0.6
    --train.colocate_all --vllm.enable_sleep --ds.enable_sleep
    --ds.zero_stage "$ZERO_STAGE" --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
    --data.prompt_dataset "$TRAIN_FILE" --data.input_key prompt --data.label_key label --data.apply_chat_template
    --reward.remote_url "$REWARD_FUNC"
    --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt "$ROLLOUT_N"
    --algo.kl.use_loss --algo.kl.init_coef 0.001 --algo.kl.estimator k3
    --rollout.batch_size "$ROLLOUT_BATCH" --train.batch_size "$TRAIN_BATCH" --train.micro_batch_size 4
    --rollout.micro_batch_size 8 --data.max_len $((MAX_PROMPT_LEN + MAX_RESPONSE_LEN))
    --rollout.max_new_tokens "$MAX_RESPONSE_LEN" --rollout.temperature 1.0
    --actor.adam.lr "$LR" --train.num_episodes "$EPISODES" --train.seed 42
    --ckpt.output_dir "$OUTPUT_DIR" --ckpt.path "$OUTPUT_DIR/ckpt" --ckpt.save_steps 50
    --logger.tensorboard_dir "$OUTPUT_DIR/tb"
  )
}

# run (or, with DRY_RUN=1, print) the command: plain OpenRLHF for the baseline, the OAR entry point otherwise
launch() {
  local module=oar_verl.openrlhf.train_ppo_ray
  [[ "$ALGO" == grpo ]] && module=openrlhf.cli.train_ppo_ray
  local cmd=(python -m "$module" "${ARGS[@]}" "$@")
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q\n' "${cmd[@]}"
  else
    exec "${cmd[@]}"
  fi
}
