"""Supervised fine-tuning: task heads on a pretrained backbone (frozen probe, LoRA, full).

``data`` reads labelled tables and splits them, ``module`` is the LightningModule (losses and
metrics), ``train`` holds ``finetune(cfg)``. The heads themselves are in
``protein_performer.model.task_heads`` and fine-tuned checkpoints are read (and LoRA merged) by
``protein_performer.interop.finetuned``, so inference needs nothing from this package.
"""
