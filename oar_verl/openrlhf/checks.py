"""Start-up and first-``fit`` checks that keep OAR from silently doing nothing under OpenRLHF.

* :func:`check_openrlhf_version`: the adapter reaches into OpenRLHF's internals (the replay buffer's items, the policy
  actor's ``fit``, the CLI module's actor class), so an OpenRLHF outside the tested release is refused by default.
* :func:`check_policy_loss`: loss forms under which a mass-preserving reshaping cannot change the gradient.
* :func:`startup_check_flags`: the start-up checks every integration runs, on the ``--oar.*`` flags and the policy.
* :func:`guard_actor_groups`: the policy actor group OpenRLHF builds must be OAR's, checked when the group is built and
  again, on the actors themselves, at the first ``fit``.

Imports OpenRLHF lazily (the entry point's flag handling runs without it).
"""

from __future__ import annotations

from typing import Any

from oar_verl.core.checks.versions import check_tested_release

TESTED_OPENRLHF = "0.11.2"  # the release the adapter is tested against (tests/openrlhf, docs/openrlhf.md)
ALLOW_UNTESTED_ENV = "OAR_OPENRLHF_ALLOW_UNTESTED"


class OpenRLHFArgsError(SystemExit):
    """An OpenRLHF flag OAR cannot be sound with (exit status 2, like argparse)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class OpenRLHFVersionError(OpenRLHFArgsError):
    """OpenRLHF outside the tested release (exit status 2)."""


def check_openrlhf_version(version: str | None = None, *, allow_untested: bool | None = None) -> str:
    """Refuse an OpenRLHF other than :data:`TESTED_OPENRLHF`, naming both; ``OAR_OPENRLHF_ALLOW_UNTESTED=1`` turns the
    refusal into a warning. Returns the version found.

    Another release can move what the adapter relies on (the replay buffer's per-sample ``Experience`` layout, where
    the CLI takes the policy actor class from, ``PolicyModelActor.fit``) without any error, which would leave the
    advantages unreshaped or misaligned.
    """
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("openrlhf")
        except PackageNotFoundError:
            raise OpenRLHFVersionError(f"OpenRLHF is not installed; the adapter needs openrlhf=={TESTED_OPENRLHF} "
                                       f'(pip install "oar-verl[openrlhf]")') from None
    return check_tested_release(version, TESTED_OPENRLHF, framework="OpenRLHF", extra="openrlhf",
                                allow_env=ALLOW_UNTESTED_ENV, allow_untested=allow_untested, error=OpenRLHFVersionError)


# Loss forms of OpenRLHF 0.11.2 (`--actor.policy_loss_type`, openrlhf/models/loss.py PolicyLoss) whose gradient a
# per-token reshaping that keeps every sequence's advantage mass cannot change, with the reason.
INVARIANT_LOSSES = {
    "gspo": "OpenRLHF's GSPO uses one ratio per sequence, s = exp(mean_t log(pi/pi_old)), and the per-sample mean of "
            "-min(s * A_t, clip(s) * A_t): with A_t = w_t * A and w_t > 0 every token of a row takes the same branch, "
            "so the loss is -min(s, clip(s)) * A * mean_t(w_t) = -min(s, clip(s)) * A, exactly GRPO's, whatever the "
            "weights; OAR would cost its attribution passes and change nothing (verl's GSPO differs: its token ratio "
            "exp(log_prob - sg(log_prob) + sg(seq_mean)) carries each token's own gradient, so there OAR matters). "
            "Use --actor.policy_loss_type ppo",
}


def check_policy_loss(args) -> None:
    """Refuse a ``--actor.policy_loss_type`` under which OAR cannot change the gradient (:data:`INVARIANT_LOSSES`)."""

    loss = getattr(args.actor, "policy_loss_type", "ppo")
    if loss in INVARIANT_LOSSES:
        raise OpenRLHFArgsError(f"--actor.policy_loss_type={loss}: OAR's token weights cannot change this loss's "
                                f"gradient. {INVARIANT_LOSSES[loss]}")


def startup_check_flags(args, cfg) -> list[str]:
    """The start-up checks every integration runs (:func:`oar_verl.core.checks.startup.startup_checks`) on OpenRLHF's
    flags: the ``--oar.*`` values, an unsafe mask token of the policy (``--actor.model_name_or_path``: an EOS of its
    tokenizer or generation config, a chat-template token, another special token; a path that is not a local directory
    is checked at the first step), and a gradient method on a sliding-window policy past its window (rows:
    ``--data.max_len``), warned of. Returns the warnings.

    Raises:
        OpenRLHFArgsError: an error of the checks, naming the flag and how to override.
    """
    from oar_verl.core.checks.startup import startup_checks
    from oar_verl.core.config import OARConfigError

    actor = getattr(args, "actor", None)
    max_len = getattr(getattr(args, "data", None), "max_len", None)
    try:
        return startup_checks(cfg, model_path=getattr(actor, "model_name_or_path", None),
                              trust_remote_code=bool(getattr(actor, "trust_remote_code", False)),
                              max_tokens=None if max_len is None else int(max_len),
                              fidelity_check="oar_verl.core.fidelity.fidelity_report on a few rollouts "
                                             "(docs/fidelity.md)")
    except OARConfigError as e:
        raise OpenRLHFArgsError(str(e)) from e


def is_policy_actor_class(actor_type: Any, base: type) -> bool:
    """Whether a Ray actor class (or a plain class) is OpenRLHF's policy actor or derives from it."""
    cls = getattr(actor_type, "__ray_actor_class__", actor_type)
    return isinstance(cls, type) and issubclass(cls, base)


def guard_actor_groups() -> None:
    """Wrap OpenRLHF's ``RayActorGroup`` so that its policy group must be OAR's (call before its CLI module runs).

    * when a group is built: a group of OpenRLHF's ``PolicyModelActor`` (or a subclass) that is not OAR's is refused
      before any actor starts (e.g. an OpenRLHF whose CLI takes the class from elsewhere than
      ``openrlhf.trainer.ray.ppo_actor``, where the entry point swaps it);
    * OAR's policy group becomes an :class:`oar_verl.openrlhf.actor.OARPolicyGroup`, which travels as such to the
      process that calls ``fit`` (OpenRLHF's trainer is a Ray actor) and there, at the first ``fit``, asks every actor
      whether it is OAR's (:func:`oar_verl.openrlhf.actor.check_group_runs_oar`).

    Both raise :class:`oar_verl.openrlhf.actor.NotOARActorError`. Idempotent.
    """
    from openrlhf.trainer.ray.launcher import RayActorGroup

    from oar_verl.openrlhf.actor import NotOARActorError, OARPolicyGroup, OARPolicyModelActorImpl

    if getattr(RayActorGroup, "_oar_guarded", False):
        return
    base = OARPolicyModelActorImpl.__bases__[0]  # OpenRLHF's own policy actor (the module attribute may be swapped)
    init = RayActorGroup.__init__

    def guarded_init(self, num_nodes, num_gpus_per_node, ray_actor_type, *args, **kwargs):
        policy = is_policy_actor_class(ray_actor_type, base)
        if policy and not is_policy_actor_class(ray_actor_type, OARPolicyModelActorImpl):
            cls = getattr(ray_actor_type, "__ray_actor_class__", ray_actor_type)
            raise NotOARActorError(f"OpenRLHF is building its policy actor group from {cls.__module__}."
                                   f"{cls.__qualname__}, not OAR's actor: the entry point's swap of "
                                   "openrlhf.trainer.ray.ppo_actor.PolicyModelActor did not reach OpenRLHF's CLI, "
                                   "so this run would be plain OpenRLHF under an OAR name. Refusing.")
        init(self, num_nodes, num_gpus_per_node, ray_actor_type, *args, **kwargs)
        if policy and type(self) is RayActorGroup:
            self.__class__ = OARPolicyGroup  # pickled by its module path: the check goes wherever the group goes

    RayActorGroup.__init__ = guarded_init
    RayActorGroup._oar_guarded = True
