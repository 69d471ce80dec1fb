"""OAR on verl's detachable actor worker (``separate_async``), through the call sequence of its decoupled mode.

Launched by test_async_trainers_on_cpu.py in a fresh process (the CPU platform must be selected before verl is first
imported). One FSDP2 rank of :class:`OARDetachActorWorker`, in verl's legacy padded layout:

1. save the initial weights W0 as π_old (``save_model_to_cpu(0)``), then one real ``update_actor`` step: weights W1;
2. verl's ``PPOTrainerSeparateAsync._compute_old_log_prob`` for a later mini-batch of the cycle, with OAR's layer
   where the OAR trainer puts it: save W1, restore π_old, old log-probs, **attribution**, restore W1;
3. the order OAR must not use: old log-probs under π_old, restore W1, then attribution.

usage: python detach_worker_job.py MODEL_DIR OUT_FILE RAY_TMP
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from oar_verl.core.config import OARConfig
from oar_verl.integration.fields import CONFIG_KEY, STEP_KEY
from oar_verl.integration.worker import OARDetachActorWorker
from job_support import actor_group, saved, tokenized, trainer_config

RESPONSES = ["3 plus 4 is 7. The answer is 7.", "12 plus 30 is 42. The answer is 42.",
             "5 plus 9: count up from 5 by nine steps, which gives 14. The answer is 14.",
             "Seven and eight make fifteen, so #### 15"]


def padded_batch(model_dir) -> DataProto:
    """verl's legacy layout: left-padded prompts, right-padded responses."""
    tok, prompts, responses = tokenized(model_dir, RESPONSES)
    P, T, pad = max(map(len, prompts)), max(map(len, responses)), tok.pad_token_id
    p_ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    r_ids = torch.tensor([r + [pad] * (T - len(r)) for r in responses])
    p_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    r_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses])
    attention = torch.cat([p_mask, r_mask], 1)
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": attention,
                                        "position_ids": position, "prompts": p_ids, "responses": r_ids,
                                        "response_mask": r_mask},
                               non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})


def main() -> None:
    model_dir, out_file, ray_tmp = sys.argv[1:4]
    cfg = trainer_config(model_dir, batch_size=4, micro_batch_size=2,
                         extra=["actor_rollout_ref.actor.optim.lr=0.05", "actor_rollout_ref.rollout.n=1"])
    with actor_group(OARDetachActorWorker, cfg, ray_tmp) as wg:
        batch = padded_batch(model_dir)
        oar = OARConfig(mode="gradient", probe="as_mean")

        def td(extra=None, **non_tensor):
            b = batch if extra is None else batch.union(extra)
            data = left_right_2_no_padding(b.to_tensordict())
            tu.assign_non_tensor(data, temperature=1.0, **non_tensor)
            return data

        def old_log_probs():
            out = wg.compute_log_prob(td(compute_loss=False, calculate_entropy=False))
            return out["log_probs"]

        def attribute():
            out = wg.compute_token_importance(td(**{CONFIG_KEY: oar.to_dict(), STEP_KEY: 3}))
            return {k: out[k] for k in ("token_importance", "oar_params_fingerprint", "oar_log_prob_params_fingerprint")}

        # 1. π_old = W0, then one update: W1
        wg.save_model_to_cpu(0)
        logp0 = old_log_probs()
        T = batch.batch["responses"].shape[1]
        logp = torch.nested.as_nested_tensor([t[-T:] for t in logp0.unbind()], layout=torch.jagged)
        logp = logp.to_padded_tensor(0.0)[:, :T] * batch.batch["response_mask"]
        adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]) * batch.batch["response_mask"]
        update = DataProto.from_dict(tensors={"old_log_probs": logp, "advantages": adv})
        wg.update_actor(td(update, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                           global_batch_size=4, mini_batch_size=4, epochs=1, seed=0,
                           dataloader_kwargs={"shuffle": False}, compute_loss=True))
        # 2. separate_async, a later mini-batch of the cycle, with OAR's layer inside the π_old window
        wg.save_model_to_cpu(1)
        wg.restore_model_from_cpu(0)
        old_log_probs()
        inside = attribute()
        wg.restore_model_from_cpu(1)
        wg.clear_cpu_model(1)
        # 3. the wrong order: the current weights restored before attribution
        wg.save_model_to_cpu(2)
        wg.restore_model_from_cpu(0)
        old_log_probs()
        wg.restore_model_from_cpu(2)
        outside = attribute()
        save = {"prompts": [row.clone() for row in batch.batch["prompts"]],
                "responses": [row.clone() for row in batch.batch["responses"]], "config": oar.to_dict()}
        for name, res in (("inside", inside), ("outside", outside)):
            save[name] = {k: saved(v) for k, v in res.items()}
        torch.save(save, out_file)


if __name__ == "__main__":
    main()
