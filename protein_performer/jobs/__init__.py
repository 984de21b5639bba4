"""The commands' file drivers, one module per job: FASTA (or a store) in, HDF5 or CSV out, with
parts, merge, standard output and resume. Each runs over the API (:class:`~protein_performer.
inference.api.ProteinLM`), never around it, so a file holds what a script gets from ``lm``."""
