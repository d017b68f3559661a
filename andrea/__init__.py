"""ANDREA: a reproducible pipeline that trains small GPT-style language models.

Every stage is a subcommand of the ``andrea`` CLI (see ``andrea --help``); the
Snakemake rules in ``workflow/rules`` and the stages in ``dvc.yaml`` only wire
inputs, outputs and params to those commands.
"""

__version__ = "0.1.0"
