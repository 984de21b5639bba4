"""``protein-performer train [overrides]``: train a model from the package's Hydra configs."""

from __future__ import annotations

import argparse

from protein_performer.cli._args import add_command
from protein_performer.cli._wrote import say_wrote_run

HELP = "train a model (Hydra overrides, e.g. experiment=demo)"
DESCRIPTION = """\
Train a Performer protein language model. The run is configured by Hydra: train.yaml plus the
config groups of the package's conf/ (or of $PROTEIN_PERFORMER_CONF_DIR), changed with
overrides on the command line:

  group=option     pick a config of a group (experiment, model, data, trainer, logger, debug)
  key=value        change one key, e.g. trainer.max_steps=1000 model.config.kernel=relu
  +key=value       add a key that the config does not have
  ckpt_path=PATH   resume a run from its checkpoints/last.ckpt (same LR schedule, data position)
  ckpt_path=last   resume from the newest last.ckpt of this run directory (start if none)
  run_name=NAME    the run directory's name (default: the launch time); a stable name lets the
                   same command resume after a crash, SIGTERM or SLURM requeue

Each run writes outputs/<task_name>/<run_name>/ (in the launch directory, or in
$PROTEIN_PERFORMER_ROOT when set; hydra.run.dir=DIR names another): checkpoints/ (best +
last.ckpt), metrics (csv/ by default), the training-curve PNG, the log and the composed config
(.hydra/).
last.ckpt follows every validation, the end of training and SIGTERM (exit status 143). A NaN
or infinite loss stops the run with one error line (exit status 2).
Hydra's own flags also work: --cfg job (print the composed config), -m (multirun sweep),
--hydra-help.
"""

EXAMPLES = """\
examples:
  protein-performer train experiment=demo                  # tiny CPU demo, a few minutes
  protein-performer train experiment=demo debug=fdr        # one batch through everything
  protein-performer train experiment=small_mlm trainer=gpu logger=tensorboard
  protein-performer train experiment=small_clm trainer=ddp trainer.devices=4
  protein-performer train experiment=demo ckpt_path=outputs/demo/<run>/checkpoints/last.ckpt
  protein-performer train experiment=uniref50_mlm run_name=job$SLURM_JOB_ID ckpt_path=last
  WANDB_MODE=offline protein-performer train experiment=demo logger=wandb
"""


def _choices_epilog() -> str:
    # Listed from the config directory at --help time: new experiment files show up by themselves.
    try:
        from protein_performer.training.compose import conf_dir, list_choices
    except ImportError:  # pragma: no cover - broken install; the run itself will say more
        return EXAMPLES
    try:
        where = conf_dir()
    except Exception:  # noqa: BLE001 - help must print even when the config dir is missing
        return EXAMPLES
    lines = [f"config groups (from {where}):"]
    for group in ("experiment", "model", "data", "trainer", "logger", "debug"):
        options = list_choices(group)
        if options:
            lines.append(f"  {group + ':':<12}{', '.join(options)}")
    return "\n".join(lines) + "\n\n" + EXAMPLES


#: The Hydra keys naming what this command writes (Hydra's run directory and the run's own),
#: each claimed under the output policy (protein_performer.io.outputs) before Hydra creates
#: anything; tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("hydra.run.dir", "paths.output_dir")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "train",
        HELP,
        DESCRIPTION,
        _choices_epilog(),
        usage="%(prog)s [-h] [OVERRIDE ...]",
    )
    p.set_defaults(func=run, accepts_overrides=True, own_sigterm=True)


def run(args: argparse.Namespace) -> int:
    from protein_performer.training.train import run_hydra

    result = run_hydra(args.overrides)
    if result.get("global_rank", 0) == 0:  # one report per job, not one per DDP rank
        for key in ("best_checkpoint", "last_checkpoint", "curve"):
            if result.get(key):
                print(f"{key.replace('_', ' ')}: {result[key]}")
        say_wrote_run(result)
    return 0
