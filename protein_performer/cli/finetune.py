"""``protein-performer finetune base=CKPT data.train=labels.csv task=... mode=...``: supervised
fine-tuning from the package's Hydra configs ``finetune.yaml``, ``task/``, ``mode/``."""

from __future__ import annotations

import argparse

from protein_performer.cli._args import add_command
from protein_performer.cli._wrote import say_wrote_run

HELP = "fine-tune a head on labelled sequences (frozen probe, LoRA or full; Hydra overrides)"
DESCRIPTION = """\
Fine-tune a pretrained model on labelled sequences. Configured by Hydra: finetune.yaml of the
package's conf/ (or of $PROTEIN_PERFORMER_CONF_DIR) plus the groups task/ (regression,
classification, residue_classification), mode/ (frozen, lora, full), trainer/ and logger/,
changed with key=value overrides:

  base=CKPT              the pretrained model (a .ckpt, an export directory, ESM-2 weights)
  data.train=FILE        CSV/TSV: a sequence column (or id + data.fasta=FASTA), label
                         column(s) (data.labels=[COL,...]), an optional split column
  task=NAME mode=NAME    what to predict and what trains (see below)
  task.pooling=mean|cls|attention   how a sequence task pools residues
  data.split_by=column|random|cluster (also --split-by; cluster needs MMseqs2)
  experiment=NAME        a recipe from finetune_experiment/ (one per task type)
  run_name=NAME ckpt_path=last     resume a run after a crash or SIGTERM

modes: frozen (backbone features cached once, only the head trains: seconds), lora (PEFT LoRA
adapters on attention q/k/v/out and FFN fc1/fc2 + the head), full (everything).
Writes outputs/finetune/<run_name>/ (in the launch directory, or in $PROTEIN_PERFORMER_ROOT
when set; hydra.run.dir=DIR names another): checkpoints/ (best + last.ckpt, each opened by
pp.load and `protein-performer predict`), metrics (csv/), the training curve, the log and the
composed config (.hydra/). threads=N sets torch's CPU threads (default: the free cores).
Metrics: val/loss plus spearman, pearson, mse (regression); acc, auroc, mcc (classification);
acc, f1 (residues).
Rows without a label are skipped and counted (data.on_nan=error refuses them). A NaN loss
stops the run with one error line (exit status 2); last.ckpt follows every validation.
"""

EPILOG = """\
examples:
  protein-performer finetune base=model.ckpt data.train=fitness.csv task=regression mode=lora
  protein-performer finetune base=model.ckpt data.train=dms.csv data.labels=[2500] mode=frozen
  protein-performer finetune base=esm2_8m data.train=loc.csv task=classification mode=full
  protein-performer finetune base=m.ckpt data.train=ss.csv task=residue_classification \\
      --split-by cluster
  protein-performer finetune experiment=regression base=m.ckpt data.train=f.csv run_name=r1 \\
      ckpt_path=last
"""


#: The Hydra keys naming what this command writes (Hydra's run directory and the run's own),
#: each claimed under the output policy (protein_performer.io.outputs) before Hydra creates
#: anything; tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("hydra.run.dir", "paths.output_dir")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "finetune", HELP, DESCRIPTION, EPILOG, usage="%(prog)s [-h] [OVERRIDE ...]"
    )
    p.add_argument(
        "--split-by",
        choices=("column", "random", "cluster"),
        default=None,
        help="same as data.split_by=...: the table's split column, a seeded random split, or "
        "MMseqs2 clusters kept whole (data.identity, default 0.9)",
    )
    p.set_defaults(func=run, accepts_overrides=True, own_sigterm=True)


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The Hydra overrides a command line stands for (``experiment=`` names the group
    ``finetune_experiment``, ``--split-by X`` is ``data.split_by=X``)."""
    out = []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        out.append(f"finetune_experiment={value}" if sep and key == "experiment" else item)
    if args.split_by:
        out.append(f"data.split_by={args.split_by}")
    return out


def run(args: argparse.Namespace) -> int:
    from protein_performer.finetune.train import FINETUNE_ENTRY
    from protein_performer.training.runner import launch

    result = launch(FINETUNE_ENTRY, overrides_of(args))
    # Nothing to report after Hydra's own flags (--cfg job), nor from DDP ranks other than 0.
    if not result or result.get("global_rank", 0) != 0:
        return 0
    metrics = {k: v for k, v in result["metrics"].items() if k.startswith(("val/", "test/"))}
    print(" ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if isinstance(v, float)))
    for key in ("best_checkpoint", "last_checkpoint"):
        if result.get(key):
            print(f"{key.replace('_', ' ')}: {result[key]}")
    say_wrote_run(result)
    return 0
