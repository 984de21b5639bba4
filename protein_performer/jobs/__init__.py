"""The commands' file drivers, one module per job: FASTA (or a store) in, HDF5 or CSV out, with
parts, merge, standard output and resume. They sit above the API
(:class:`~protein_performer.inference.api.ProteinLM`): the numbers a file holds are those a
script gets from ``lm``'s methods (``eval``'s: ``lm.measure``), never from ``lm.loaded``. A file
format with a reader of its own has a module of its own (``embeddings_file``)."""
