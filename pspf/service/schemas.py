"""A topic's schemas: set a new version (its compatibility checked first), show one, list them all.

Each version is a record in the topic's schema hash (``keys.schemas_key``): the JSON Schema, the
compatibility it was checked under and when it was set. The current version is the highest. A
version is added with HSETNX, so two operators setting at once cannot both take one number: the
second is told to look again. Every door that writes the topic checks values against the current
version and writes its number in the entry (the ``schema`` field); a worker checks an entry
against the version it names (the current one when it names none).
"""

from __future__ import annotations

from typing import Any

from pspf import keys
from pspf.contracts.registry import COMPAT_MODES, SchemaVersion, add_version, read_versions
from pspf.errors import ConfigError, NotFound
from pspf.service.base import Family


class Schemas(Family):
    """Set, show and list the versions of a topic's schema."""

    def set_schema(self, topic: str, schema: Any, compat: str = "backward") -> SchemaVersion:
        """Add ``schema`` as the topic's next version, once it is compatible with the current one.

        Raises:
            NotFound: no such topic.
            ConfigError: a schema outside the subset PSPF checks, an unknown compatibility, or a
                change the compatibility refuses (each problem named), or another version set meanwhile.
        """
        keys.check_name("topic", topic)
        if compat not in COMPAT_MODES:
            raise ConfigError(f"--compat must be one of {', '.join(COMPAT_MODES)}, got {compat!r}")
        self.broker.topics.topic_partitions(topic)  # NotFound for a topic that does not exist
        return add_version(self.broker, topic, schema, compat)

    def show(self, topic: str, version: int | None = None) -> SchemaVersion:
        """The current version of the topic's schema, or version ``version``.

        Raises:
            NotFound: no such topic, no schema, or no such version.
        """
        keys.check_name("topic", topic)
        self.broker.topics.topic_partitions(topic)
        versions = read_versions(self.broker, topic)
        if not versions:
            raise NotFound(f"topic {topic!r} has no schema (pspf topic schema set {topic} ...)")
        wanted = max(versions) if version is None else version
        if wanted not in versions:
            raise NotFound(f"topic {topic!r} has no schema v{wanted} (it has v1 to v{max(versions)})")
        return versions[wanted]

    def history(self, topic: str) -> list[SchemaVersion]:
        """Every version of the topic's schema, the first first (none: [])."""
        keys.check_name("topic", topic)
        self.broker.topics.topic_partitions(topic)
        return list(read_versions(self.broker, topic).values())
