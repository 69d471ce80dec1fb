"""``python -m oar_verl.main``: verl's PPO entry point with OAR.

Same config tree and overrides as ``python -m verl.trainer.main_ppo`` plus the declared ``algorithm.oar.*`` keys. The
OAR configuration is validated here, in the driver, before Ray starts: a bad value fails in seconds, naming the key.
``trainer.use_v1`` (default true) selects verl's V1 trainers: the user's ``trainer.v1.trainer_mode`` (``sync``,
``colocate_async`` or ``separate_async``) runs as its OAR counterpart (``oar_<mode>``); false selects the legacy
``RayPPOTrainer``.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, open_dict


@hydra.main(config_path="integration/config", config_name="oar_trainer", version_base=None)
def main(config: DictConfig) -> None:
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    from oar_verl.integration import plugin  # registers the estimator and trainers in this process too
    from oar_verl.integration.guard import uses_oar
    from oar_verl.integration.startup import validate_oar_setup
    from oar_verl.integration.trainer_v1 import oar_trainer_mode

    if not plugin.loaded:
        raise RuntimeError("oar_verl failed to load its verl plugin; see the warning above")
    auto_set_device(config)
    if uses_oar(config):
        validate_oar_setup(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if config.trainer.use_v1:
        with open_dict(config):  # the user's mode, with OAR (a mode OAR cannot extend fails here, naming the key)
            config.trainer.v1.trainer_mode = oar_trainer_mode(config.trainer.v1.trainer_mode)
        run_ppo(config, task_runner_class=TaskRunnerV1)
    else:
        from oar_verl.integration.trainer_legacy import OARTaskRunner

        run_ppo(config, task_runner_class=OARTaskRunner)


if __name__ == "__main__":
    main()
