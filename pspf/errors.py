"""The one exception tree of PSPF.

Every error a user can cause or meet is a ``PSPFError``; the CLI prints its message on one line and
exits with its ``exit_code``, so scripts can tell a bad argument from an unreachable broker.
"""

from __future__ import annotations

from collections.abc import Callable
from string import Formatter


class PSPFError(Exception):
    """Root of every error PSPF raises on purpose."""

    exit_code = 1


class ConfigError(PSPFError):
    """Bad settings, arguments or input given by the user."""

    exit_code = 2


class ParameterError(ConfigError):
    """An operation's parameter, or a combination of them, that the operation refuses.

    The CLI and the admin API spell a parameter differently (``--older-than``, ``older_than``), so
    the message is a template that marks each parameter as ``{name}``, named as the admin API's
    request fields name it; ``values`` fill the other fields, so text a user gave is never read as
    a template. Each face phrases the message with its own spelling (``phrase``); ``str()`` gives
    the bare names.
    """

    def __init__(self, template: str, **values: object) -> None:
        self.template = template
        self.values = values
        self.params = [name for _, name, _, _ in Formatter().parse(template) if name and name not in values]
        super().__init__(self.phrase(str))

    @classmethod
    def invalid(cls, param: str, problem: str) -> ParameterError:
        """``param`` has a value the operation cannot take; ``problem`` says why."""
        return cls("{" + param + "}: {problem}", problem=problem)

    def phrase(self, spell: Callable[[str], str]) -> str:
        """The message with each parameter named by ``spell(name)``."""
        return self.template.format_map({**{p: spell(p) for p in self.params}, **self.values})


class BrokerError(PSPFError):
    """Redis is unreachable, refused a command, or lacks a needed feature."""

    exit_code = 3


class BrokerUnavailable(BrokerError):
    """The connection to Redis failed or timed out; a worker reconnects with backoff."""

    #: what a worker says is unavailable while it backs off
    what = "Redis"


class SinkUnavailable(BrokerUnavailable):
    """A sink's database wrote nothing (unreachable, rows refused, or the partition taken over).

    A worker backs off and reads the batch again, as after a lost connection to Redis: nothing
    of it was acknowledged.
    """

    what = "sink database"


class SinkDatabaseRefused(BrokerError):
    """A sink's database refused the connection for good: a login, a database that does not exist.

    Not retried, as ``AuthenticationFailed``: the server answered, and will answer the same.
    """


class BrokerOutOfMemory(BrokerUnavailable):
    """The server refused a write because it reached its maxmemory (policy ``noeviction``).

    A temporary outage for a worker: it backs off and retries, as after a lost connection, until
    memory is freed. A refused call wrote nothing (Redis refuses a script or a MULTI before its
    first write), so the batch in hand stays committed locally and pending in Redis.
    """


class EvictingPolicy(BrokerError):
    """The server's ``maxmemory-policy`` may evict keys: PSPF's streams, backups and leases may vanish.

    Not retried: exactly-once cannot hold on such a server, so a worker stops before it
    acknowledges anything more.
    """


class AuthenticationFailed(BrokerError):
    """The server refused the login: a wrong password or user name, or none where one is needed.

    Not retried: the server answered, and will answer the same until the URL changes.
    """


class GroupMissing(BrokerError):
    """The app's consumer group vanished from a stream under a running worker."""


class BrokerDataLost(BrokerError):
    """The server lost what an app's state depends on (its group and backup, or its record).

    A restart without persistence, a flush or eviction. The worker stops: going on would mix
    partitions that kept their state with partitions that lost it.
    """


class StreamWentBack(BrokerError):
    """A stream's last generated id is below the app's checkpoint: nothing more is acknowledged.

    The topic was made anew, or Redis lost writes.
    """


class LeaseLost(BrokerError):
    """The partition lease is no longer ours: another worker may own the partition now."""

    #: what the worker logs when it gives the partition up for this
    what = "lease lost"


class MemoryFull(BrokerError):
    """The server is near its maxmemory: producing stops before it evicts or refuses writes."""


class BackupWentBack(LeaseLost):
    """The partition's state backup is behind this owner's store: the server lost writes.

    A fail-over to a replica that had not caught up does that. The partition is given up like a
    lost lease, and taking it again rebuilds the store from the backup, which matches the
    server's streams.
    """

    what = "the state backup went back (it does not hold what this worker sent)"


class BackupDamaged(LeaseLost):
    """The partition's state backup lacks its values (deleted or evicted) while its meta remains.

    Its owner uploads its store again (``PartitionBackup.repaired``); anyone else gives the
    partition up like a lost lease.
    """

    what = "the state backup lost its values (deleted or evicted)"


class StateError(PSPFError):
    """A state store cannot be opened, read or committed."""

    exit_code = 5


class StoreLocked(StateError):
    """Another process has the state store open."""


class StateOutOfReach(StateError):
    """A partition's state is in no state backup and not in this state directory: out of reach."""


class SinkTargetChanged(StateError):
    """A sink's table is not the one its checkpoints describe: dropped, truncated or replaced.

    Going on would skip every entry the checkpoints cover, which the table no longer holds.
    """


class LaterStore(StateError):
    """A store holds entries the state adopted after Redis lost the app's data lacks.

    It is never restored over; the operator adopts it (``pspf state adopt``) or deletes it.
    """


class CheckpointRegression(StateError):
    """A checkpoint would move backwards: a bug guard, never expected in operation."""


class AppRunning(PSPFError):
    """The operation needs the app stopped, and a worker of it holds partition leases."""

    exit_code = 6


class UnderWay(AppRunning):
    """The same operation is under way on the same thing (a repartition of the topic): it must end first."""


class DecodeError(PSPFError):
    """An entry cannot become the value type its handler declares."""


class SchemaError(DecodeError):
    """A value does not match its topic's schema (``pspf topic schema``): the field and the rule."""

    exit_code = 2


class NotFound(PSPFError):
    """A topic, app or key does not exist."""

    exit_code = 4


class NonRetryableError(PSPFError):
    """Raised by a handler to say that retrying the entry cannot help."""


class StateValueError(StateError, NonRetryableError):
    """A state value PSPF cannot encode, read back or show, such as a ``ctx.state`` key that is not a string.

    The entry that writes one fails at once, without retries: every later entry of its key would
    fail reading it back. The store itself is sound, so this never stops a worker.
    """


class WrongPartition(NonRetryableError):
    """A keyed entry in a partition its key does not map to (``CRC32(key) mod P``).

    Its producer partitions by another function. Applied there, the key's state would live in a
    partition where ``pspf state get`` and every correctly placed entry of the key never look,
    so the entry is dead-lettered without running, and its partition goes on.
    """


class LateEntry(NonRetryableError):
    """An entry whose windows had all closed, dead-lettered because its app asked (``late="dlq"``)."""
