"""PSPF: stateful stream processing with exactly-once state on Redis and Valkey Streams.

The names below are loaded on first use, so importing a small part of PSPF (``pspf.errors``, or
``pspf.state_stores``, which uses it) does not load the worker and everything it needs.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pspf.app import App
    from pspf.context import Context, TimerContext
    from pspf.dataflow import Stream, agg
    from pspf.errors import (
        BrokerError,
        ConfigError,
        DecodeError,
        LateEntry,
        NonRetryableError,
        NotFound,
        PSPFError,
        StateError,
        WrongPartition,
    )
    from pspf.failures import RetryPolicy
    from pspf.hooks import ProcessorHooks
    from pspf.producer import Producer
    from pspf.settings import Settings
    from pspf.worker.process import Worker

__version__ = "0.1.0"

_WHERE = {
    "App": "pspf.app",
    "BrokerError": "pspf.errors",
    "ConfigError": "pspf.errors",
    "Context": "pspf.context",
    "DecodeError": "pspf.errors",
    "LateEntry": "pspf.errors",
    "NonRetryableError": "pspf.errors",
    "NotFound": "pspf.errors",
    "PSPFError": "pspf.errors",
    "ProcessorHooks": "pspf.hooks",
    "Producer": "pspf.producer",
    "RetryPolicy": "pspf.failures",
    "Settings": "pspf.settings",
    "StateError": "pspf.errors",
    "TimerContext": "pspf.context",
    "Worker": "pspf.worker",
    "WrongPartition": "pspf.errors",
    "agg": "pspf.dataflow",
    "Stream": "pspf.dataflow",
}

__all__ = [
    "App",
    "BrokerError",
    "ConfigError",
    "Context",
    "DecodeError",
    "LateEntry",
    "NonRetryableError",
    "NotFound",
    "PSPFError",
    "ProcessorHooks",
    "Producer",
    "RetryPolicy",
    "Settings",
    "StateError",
    "Stream",
    "TimerContext",
    "Worker",
    "WrongPartition",
    "__version__",
    "agg",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pspf' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
