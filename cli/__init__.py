"""The ``pspf`` command line; importing this package registers every subcommand."""

from cli import commands, operations
from cli.main import cli

__all__ = ["cli", "commands", "operations"]
