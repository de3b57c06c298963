"""Which store is an app's state after Redis lost its data: the adoption record and its rules.

After a total loss every machine may hold a store of a partition: the later one (the last owner's)
and stale ones. `pspf state adopt` uploads the store of the machine it runs on as the
partition's backup and writes an adoption record into the backup's meta (``BACKUP_ADOPTED``): a
new id, the store's checkpoints, and the ids of the adoptions it replaced. Every store that
joins the adopted history (the adopted one, and each one restored from the backup since) is
stamped with the id, under ``BACKUP_NAMESPACE``.

A store without the stamp comes from before the adoption: its identity says nothing about the
adopted history (fencing tokens started again with the server), so it is never taken as in
sync with the backup, and it is restored from it only when its checkpoints are not later than
the adopted ones. A later store is refused (``LaterStore``): adopting it on its machine makes it
the state. A store stamped with a replaced adoption is from a history the operator replaced: it
follows the backup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import msgspec

from pspf.errors import LaterStore
from pspf.keys import BACKUP_ADOPTED, BACKUP_IDENTITY, BACKUP_NAMESPACE, StreamId

if TYPE_CHECKING:
    from pspf.state_stores import StateStore

#: How a store's checkpoints relate to the adopted ones, topic by topic.
Relation = Literal["same", "behind", "later", "apart"]


class Adoption(msgspec.Struct, frozen=True, kw_only=True):
    """What `pspf state adopt` made a partition's state (the backup meta's ``BACKUP_ADOPTED``)."""

    id: str
    #: topic -> the adopted store's checkpoint
    checkpoints: dict[str, str]
    #: the ids of the adoptions this one replaced (a later store adopted after them)
    replaced: list[str] = []

    def positions(self) -> dict[str, StreamId]:
        return {topic: StreamId.parse(at) for topic, at in self.checkpoints.items()}

    def encode(self) -> str:
        return _encoder.encode(self).decode()


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Adoption)


def adoption_of(meta: Mapping[str, str]) -> Adoption | None:
    """The adoption record of a backup's meta; None when the backup was not adopted."""
    raw = meta.get(BACKUP_ADOPTED)
    return None if raw is None else _decoder.decode(raw)


def stamp_of(store: StateStore) -> str:
    """The id of the adoption a store follows ("" for none)."""
    raw = store.get(BACKUP_NAMESPACE, BACKUP_ADOPTED)
    return "" if raw is None else raw.decode()


def stamp(store: StateStore, adoption: Adoption | None) -> None:
    """Record that the store follows ``adoption`` now (it was made equal to its backup)."""
    if adoption is not None and stamp_of(store) != adoption.id:
        store.write({(BACKUP_NAMESPACE, BACKUP_ADOPTED): adoption.id.encode()}, {})


def compare(mine: Mapping[str, StreamId], adopted: Mapping[str, StreamId]) -> Relation:
    """How checkpoints ``mine`` relate to ``adopted`` (a missing checkpoint is the lowest)."""
    later = behind = False
    for topic in {*mine, *adopted}:
        a, b = mine.get(topic), adopted.get(topic)
        if a == b:
            continue
        if b is None or (a is not None and a > b):
            later = True
        else:
            behind = True
    if later:
        return "apart" if behind else "later"
    return "behind" if behind else "same"


def trusted_identity(store: StateStore, adoption: Adoption | None) -> str:
    """The store's identity where it belongs to the backup's history; "" where it cannot.

    A store from before the adoption (or from a replaced one) may carry an identity the adopted
    history reuses for other values.
    """
    if adoption is not None and stamp_of(store) != adoption.id:
        return ""
    raw = store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY)
    return "" if raw is None else raw.decode()


def refuse_later(store: StateStore, adoption: Adoption | None, where: str, app: str = "APP") -> None:
    """Refuse to restore over a store from before the adoption whose checkpoints are later.

    Such a store holds entries the adopted one lacks (it was the later owner's); restoring over
    it would lose them. One stamped with a replaced adoption follows the backup. ``where`` names
    the store's partition in the message, ``app`` the app in the command it gives.
    """
    if adoption is None or store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY) is None:
        return  # never made equal to a backup (new, imported), or a restore cut short
    mark = stamp_of(store)
    if mark == adoption.id or mark in adoption.replaced:
        return
    mine = store.checkpoints()
    relation = compare(mine, adoption.positions())
    if relation in ("same", "behind"):
        return
    raise LaterStore(
        f"the store here of {where} is {_later(relation)} the state "
        f"adopted after Redis lost the app's data ({shown(mine)}; adopted: "
        f"{shown(adoption.positions())}): it holds entries the adopted state lacks, so it is not "
        f"restored over and nothing was processed. Run `pspf state adopt {app}` on this machine "
        "(the app stopped) to make it the state, or delete it to follow the adopted state"
    )


def _later(relation: Relation) -> str:
    return "later than" if relation == "later" else "ahead in some topics and behind in others of"


def shown(checkpoints: Mapping[str, StreamId]) -> str:
    """Checkpoints as the messages show them: ``topic at id``, sorted; "no checkpoint" for none."""
    return ", ".join(f"{t} at {at}" for t, at in sorted(checkpoints.items())) or "no checkpoint"
