"""Run one sink in a process of its own: ``python -m tests.sinks.sink_child MODULE:CLASS TOPIC KWARGS``.

``KWARGS`` is the JSON of the sink's constructor arguments; the settings come from the ``PSPF_*``
variables; ``--until-idle`` stops once nothing is left. The conformance suite kills it with SIGKILL.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys

from pspf import Settings
from pspf.sink import Sink


def main(argv: list[str]) -> int:
    factory, topic, kwargs = argv[:3]
    module, _, name = factory.partition(":")
    sink: Sink = getattr(importlib.import_module(module), name)(**json.loads(kwargs))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    summary = sink.run(topic, Settings.load(), until_idle="--until-idle" in argv[3:])
    print(f"handled {summary.handled} skipped {summary.skipped}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
