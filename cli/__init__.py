"""The ``pspf`` command line; importing this package registers every subcommand."""

from pspf.cli import (
    adopt,
    commands,
    docs,
    operations,
    repartition,
    savepoints,
    schemas,
    server,
    sink,
    source,
    state_transfer,
)
from pspf.cli.main import cli

__all__ = [
    "adopt",
    "cli",
    "commands",
    "docs",
    "operations",
    "repartition",
    "savepoints",
    "schemas",
    "server",
    "sink",
    "source",
    "state_transfer",
]
