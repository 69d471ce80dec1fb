"""OpenRLHF 0.11's own ``train_ppo_ray``, run unchanged with OAR's policy actor and OAR's start-up checks.

usage::

    python -m oar_verl.openrlhf.train_ppo_ray --oar.mode=gradient ... <OpenRLHF's own train_ppo_ray flags>

The policy actor class becomes :class:`oar_verl.openrlhf.actor.OARPolicyModelActor`, and OpenRLHF's strategy factory
first runs :func:`check_args` and attaches the validated OAR settings to ``args``, before any model or rollout. An
OpenRLHF other than the tested release is refused and its actor groups are guarded (:mod:`oar_verl.openrlhf.checks`).
``--oar.<key>=<value>`` takes every ``algorithm.oar.*`` key (parsed as JSON where it parses); ``--oar.dry_run`` stops
after the checks. Details: docs/openrlhf.md, "Running it".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import runpy
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from oar_verl.core.checks.startup import check_config
from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.openrlhf.checks import (OpenRLHFArgsError, OpenRLHFVersionError, check_openrlhf_version,  # noqa: F401
                                      check_policy_loss, startup_check_flags)

FLAG_PREFIX = "--oar"
OUTCOME_ESTIMATORS = ("group_norm", "rloo", "reinforce_baseline", "dr_grpo", "flash_reinforce", "reinforce")
# OAR options with no meaning or no implementation in the OpenRLHF adapter
UNSUPPORTED = {"dump_every": "token dumps are written by the verl trainer only; keep --oar.dump_every=0",
               "dump_dir": "token dumps are written by the verl trainer only",
               "base_estimator": "the base advantage is OpenRLHF's own --algo.advantage.estimator"}
# keys whose "off" value is accepted: an explicit never
_OFF = {"dump_every": 0}


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def split_oar_flags(argv: Sequence[str]) -> tuple[dict[str, Any], list[str], bool]:
    """(OAR settings, the remaining OpenRLHF argv, dry run) from a command line.

    Raises:
        OpenRLHFArgsError: a ``--oar.<key>`` without a value.
    """
    oar: dict[str, Any] = {}
    rest: list[str] = []
    dry = False
    it = iter(range(len(argv)))
    args = list(argv)
    for i in it:
        a = args[i]
        if not a.startswith(FLAG_PREFIX + "."):
            rest.append(a)
            continue
        key, eq, val = a[len(FLAG_PREFIX) + 1:].partition("=")
        if key == "dry_run":
            dry = True if not eq else bool(_value(val))
            continue
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise OpenRLHFArgsError(f"{FLAG_PREFIX}.{key} needs a value (--oar.{key}=<value>)")
            val = args[i + 1]
            next(it)
        oar[key] = _value(val)
    return oar, rest, dry


def oar_config(values: dict[str, Any]) -> OARConfig:
    """The validated OARConfig of ``--oar.*`` values (errors name the flag and the allowed values)."""
    for key, why in UNSUPPORTED.items():
        if key in values and not (key in _OFF and values[key] == _OFF[key]):
            raise OpenRLHFArgsError(f"{FLAG_PREFIX}.{key}: not available with OpenRLHF ({why})")
    try:
        return check_config(OARConfig.from_mapping(values, prefix=FLAG_PREFIX))
    except OARConfigError as e:
        raise OpenRLHFArgsError(str(e)) from e


def check_args(args, cfg: OARConfig) -> None:
    """Refuse, naming the flag, the OpenRLHF settings OAR cannot be sound with.

    OAR reshapes an outcome advantage (one value per sequence) token by token, in the policy actor, on whole
    sequences of one data-parallel rank. Hence: no critic / GAE (per-token values), no KL penalty folded into the
    per-token rewards (use it as a loss), gamma 1 (a discounted return is not one value per sequence), no ring
    attention and no DeepSpeed tensor parallelism in the actor (a rank does not hold whole sequences / whole layers for
    the attribution passes), no vision-language inputs (the attribution passes feed token ids only). Warns of a
    gradient method on a sliding-window policy past its window (:func:`startup_check_flags`).
    """
    est = args.algo.advantage.estimator
    if est not in OUTCOME_ESTIMATORS:
        raise OpenRLHFArgsError(f"--algo.advantage.estimator={est}: OAR reshapes an outcome advantage; use one of "
                                f"{', '.join(OUTCOME_ESTIMATORS)} (gae with a critic gives per-token values)")
    if getattr(args.critic, "model_name_or_path", None):
        raise OpenRLHFArgsError("--critic.model_name_or_path: OAR runs without a critic (outcome advantages only)")
    if args.algo.kl.init_coef > 0 and not args.algo.kl.use_loss:
        raise OpenRLHFArgsError("--algo.kl.init_coef > 0 without --algo.kl.use_loss folds the KL penalty into the "
                                "per-token rewards, so the advantage is no longer one value per sequence; add "
                                "--algo.kl.use_loss (KL as a loss term, as in GRPO) or set --algo.kl.init_coef 0")
    if est == "reinforce" and args.algo.advantage.gamma != 1.0:
        raise OpenRLHFArgsError(f"--algo.advantage.gamma={args.algo.advantage.gamma}: OAR needs gamma 1 with "
                                "reinforce (a discounted return differs token by token)")
    if args.ds.ring_attn_size > 1:
        raise OpenRLHFArgsError(f"--ds.ring_attn_size={args.ds.ring_attn_size}: OAR's attribution passes need whole "
                                "sequences on a rank; ring attention is not supported yet (set 1)")
    if args.ds.tensor_parallel_size > 1:
        raise OpenRLHFArgsError(f"--ds.tensor_parallel_size={args.ds.tensor_parallel_size}: OAR's attribution passes "
                                "need whole layers on a rank; DeepSpeed tensor parallelism is not supported yet (set 1)")
    if getattr(args.data, "max_images_per_prompt", 0):
        raise OpenRLHFArgsError("--data.max_images_per_prompt: OAR attributes text-only rollouts")
    if cfg.target == "reference" and not getattr(args.data, "label_key", None):
        raise OpenRLHFArgsError("--oar.target=reference needs the ground truth of every sample: set --data.label_key")
    check_policy_loss(args)
    startup_check_flags(args, cfg)


def add_oar_arguments(parser: argparse.ArgumentParser) -> None:
    """List the ``--oar.*`` flags in OpenRLHF's ``--help`` (one group; idempotent).

    Help only: the entry point takes the ``--oar.*`` flags off the command line before OpenRLHF's parser runs
    (:func:`split_oar_flags`), so these arguments never parse a value (``default=SUPPRESS`` keeps them off ``args``).
    """
    if getattr(parser, "_oar_group", False):
        return
    parser._oar_group = True
    group = parser.add_argument_group(
        "OAR (oar_verl)", "Outcome-grounded Advantage Reshaping of the outcome advantage, token by token, in the "
        "policy actor's fit. --oar.<key>=<value> or --oar.<key> <value>; values are JSON where they parse.")
    for f in dataclasses.fields(OARConfig):
        if f.name == "prefix" or f.name in UNSUPPORTED:
            continue
        default = f.default if not isinstance(f.default, tuple) else list(f.default)
        group.add_argument(f"{FLAG_PREFIX}.{f.name}", default=argparse.SUPPRESS, metavar="VALUE",
                           help=f"{f.metadata.get('help', '')} (default: {json.dumps(default)})".replace("%", "%%"))
    group.add_argument(f"{FLAG_PREFIX}.dry_run", default=argparse.SUPPRESS, action="store_true",
                       help="Check the flags (OpenRLHF's and OAR's) and stop before Ray or any model starts.")


@contextlib.contextmanager
def oar_help() -> Iterator[None]:
    """While OpenRLHF's CLI module runs: every parser it parses with lists the ``--oar.*`` flags
    (:func:`add_oar_arguments`); OpenRLHF 0.11.2 offers no hook into its parser."""
    parse = argparse.ArgumentParser.parse_args

    def parse_args(self, *args, **kwargs):
        add_oar_arguments(self)
        return parse(self, *args, **kwargs)

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = parse


def install(cfg: OARConfig, dry_run: bool = False) -> None:
    """Put the OAR actor and the checking strategy factory in place of OpenRLHF's (before its CLI module runs)."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import openrlhf.utils as orl_utils
    import ray

    from oar_verl.openrlhf.actor import ARGS_KEY, OARPolicyModelActor
    from oar_verl.openrlhf.checks import guard_actor_groups

    get_strategy = getattr(orl_utils.get_strategy, "__wrapped__", orl_utils.get_strategy)  # install() twice: rewrap

    def checked_get_strategy(args):
        check_args(args, cfg)
        setattr(args, ARGS_KEY, cfg.to_dict())
        if dry_run:
            print(f"[oar] OpenRLHF arguments accepted with OAR ({cfg.mode}); dry run, not training")
            raise SystemExit(0)
        return get_strategy(args)

    checked_get_strategy.__wrapped__ = get_strategy
    ppo_actor.PolicyModelActor = OARPolicyModelActor
    orl_utils.get_strategy = checked_get_strategy
    guard_actor_groups()  # fail loudly if OpenRLHF's policy group is not built from (or does not run) OAR's actor
    if dry_run:  # train() starts Ray only when it is not running yet: a dry run never needs it
        ray.is_initialized = lambda: True


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_openrlhf_version()
        values, rest, dry = split_oar_flags(argv)
        cfg = oar_config(values)
    except (OpenRLHFArgsError, OpenRLHFVersionError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    install(cfg, dry_run=dry)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *rest]
    try:
        with oar_help():
            runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    except OpenRLHFArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
