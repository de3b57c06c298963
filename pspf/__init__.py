"""PSPF: stateful stream processing with exactly-once state on Redis and Valkey Streams."""

from pspf.app import App
from pspf.context import Context
from pspf.errors import (
    BrokerError,
    ConfigError,
    DecodeError,
    NonRetryableError,
    NotFound,
    PSPFError,
    StateError,
)
from pspf.failures import RetryPolicy
from pspf.processor import ProcessorHooks
from pspf.producer import Producer
from pspf.settings import Settings
from pspf.worker import Worker

__version__ = "0.1.0"

__all__ = [
    "App",
    "BrokerError",
    "ConfigError",
    "Context",
    "DecodeError",
    "NonRetryableError",
    "NotFound",
    "PSPFError",
    "ProcessorHooks",
    "Producer",
    "RetryPolicy",
    "Settings",
    "StateError",
    "Worker",
    "__version__",
]
