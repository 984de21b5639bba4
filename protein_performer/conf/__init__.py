"""The Hydra configs of ``train`` and ``finetune``, shipped with the package so an installed wheel
finds them (Hydra's ``pkg://protein_performer.conf``); YAML files only, no code."""
