"""The package's version (``protein_performer.__version__``), alone in a module of the low
floor: the files the package writes record it (exports, embeddings files) and the CLI prints it,
and none of them has to import the package's entry points (``__init__.py``), which sit above
everything and import the API, jobs and training on first use."""

__version__ = "0.8.1"
