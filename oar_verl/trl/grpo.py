"""``python -m oar_verl.trl.grpo``: TRL 1.16's own GRPO script (what ``trl grpo`` runs) with OAR's trainer and config.

The same arguments as TRL's script: its ``GRPOScriptArguments`` (``--dataset_name``: a hub id, or a local folder of
json/jsonl/csv/parquet files named for their splits, as ``datasets.load_dataset`` reads them; ``--reward_funcs``: TRL's
names or dotted paths), ``ModelConfig`` (PEFT, quantisation), ``DatasetMixtureConfig`` (a recipe's ``datasets:`` list,
e.g. ``path: json`` with ``data_files`` for a single file) and ``--config recipe.yaml``, with ``OARGRPOConfig`` in place
of ``GRPOConfig`` (every ``--oar_<key>``). TRL's own ``main`` (dataset, rewards, PEFT, save, push) runs with
``OARGRPOTrainer`` in place of ``GRPOTrainer``. This is the training script, one process as it is; N processes:
``accelerate launch [--config_file ...] -m oar_verl.trl.grpo ...`` (``trl grpo`` launches TRL's script the same way).

Refused before any model is loaded, as an argparse error naming the field: invalid ``--oar_*`` values and TRL
settings OAR cannot run with (:class:`~oar_verl.trl.OARGRPOConfig`), unknown arguments, and unknown keys of the
recipe (launch options there, which ``trl``'s launcher reads, are skipped with a warning).
"""

from __future__ import annotations

import dis
import sys
import warnings
from collections.abc import Sequence

from oar_verl.core.config import OARConfigError
from oar_verl.trl.config import OARGRPOConfig, OARTRLArgsError
from oar_verl.trl.trainer import OARGRPOTrainer

__all__ = ["PROG", "main", "make_parser", "parse", "run"]

PROG = "python -m oar_verl.trl.grpo"
# recipe keys TRL's `trl` launcher reads (TrainingCommand: accelerate's launch options, and its --accelerate_config)
_TRL_LAUNCHER_KEYS = ("accelerate_config",)


def make_parser(prog: str = PROG):
    """TRL's ``TrlParser`` over TRL's GRPO script dataclasses, with ``OARGRPOConfig`` for ``GRPOConfig``."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    return TrlParser((GRPOScriptArguments, OARGRPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def _launch_keys() -> set[str]:
    """The option names ``accelerate launch`` takes (what a TRL recipe may carry for ``trl``'s launcher)."""
    from accelerate.commands.launch import launch_command_parser

    return {a.dest for a in launch_command_parser()._actions} | set(_TRL_LAUNCHER_KEYS)


def _fail(parser, message: str):
    """Exit with status 2 and one line naming what is wrong (argparse's ``error`` would print all ~300 options)."""
    parser.exit(2, f"{parser.prog}: error: {message} (all arguments: --help)\n")


def parse(argv: Sequence[str] | None = None):
    """``(script_args, training_args, model_args, dataset_args)`` from the command line and ``--config``; a bad
    ``--oar_*`` value, a TRL setting OAR refuses, an unknown argument or recipe key exits (status 2) naming it."""
    parser = make_parser()
    try:
        *parsed, from_config, from_cli = parser.parse_args_and_config(
            list(sys.argv[1:] if argv is None else argv), return_remaining_strings=True,
            separate_remaining_strings=True)
    except (OARConfigError, OARTRLArgsError) as e:  # OARGRPOConfig's construction checks
        _fail(parser, str(e))
    if from_cli:
        _fail(parser, f"unrecognized arguments: {' '.join(from_cli)}")
    keys = [k[2:] for k in from_config[::2]]  # TRL gives the recipe's unused keys as ["--key", "value", ...]
    launch = [k for k in keys if k in _launch_keys()]
    if unknown := [k for k in keys if k not in launch]:
        _fail(parser, f"unknown keys in --config: {unknown}: none is a field of GRPOScriptArguments, "
                      "OARGRPOConfig, ModelConfig or DatasetMixtureConfig")
    if launch:
        warnings.warn(f"--config keys {launch} are `accelerate launch` options (`trl grpo` hands them to its "
                      f"launcher); this is the training script and skips them: run `accelerate launch "
                      f"[options] -m oar_verl.trl.grpo ...` for more processes", stacklevel=2)
    return tuple(parsed)


def _check_trl_main(main) -> None:
    """TRL's ``main`` must take its trainer class as ``from trl import GRPOTrainer`` when called (TRL 1.16 does), so
    that the swap below reaches it; otherwise refuse rather than run TRL's plain GRPO."""
    last_const = None
    for ins in dis.get_instructions(main):
        if ins.opname == "IMPORT_NAME" and ins.argval == "trl" and isinstance(last_const, tuple) \
                and "GRPOTrainer" in last_const:
            return
        last_const = ins.argval if ins.opname == "LOAD_CONST" else last_const
    raise RuntimeError("trl.scripts.grpo.main no longer imports GRPOTrainer from trl when called: this TRL's script "
                       "cannot run OARGRPOTrainer through oar_verl.trl.grpo (tested with TRL 1.16)")


def main(script_args, training_args, model_args, dataset_args) -> None:
    """TRL's ``trl.scripts.grpo.main`` with ``OARGRPOTrainer`` as the ``GRPOTrainer`` it builds (the swap lasts the
    call); everything else (dataset, rewards, PEFT, quantisation, training, save, push) is TRL's."""
    import trl
    from trl.scripts import grpo as trl_grpo

    _check_trl_main(trl_grpo.main)
    plain = trl.GRPOTrainer
    trl.GRPOTrainer = OARGRPOTrainer
    try:
        trl_grpo.main(script_args, training_args, model_args, dataset_args)
    finally:
        trl.GRPOTrainer = plain


def run(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (default ``sys.argv[1:]``) and train."""
    main(*parse(argv))


if __name__ == "__main__":
    run()
