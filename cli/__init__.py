"""The ``pspf`` command line; importing this package registers every subcommand."""

from pspf.cli import commands, operations, repartition, server, sink
from pspf.cli.main import cli

__all__ = ["cli", "commands", "operations", "repartition", "server", "sink"]
