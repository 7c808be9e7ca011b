"""Where each stored Responses answer lives, and whose it is.

A stored response exists on the one replica that produced it, so `GET`/`DELETE
/v1/responses/{id}`, `.../cancel` and a later request with `previous_response_id` must reach that
replica. The replica serves any id to anyone who names it, so the gateway is what keeps one key
out of another's answers: an id belongs to the key whose request created it, and for any other
key (admins excepted) it does not exist.

Bounded whatever clients send: ids longer than `MAX_ID` are never stored, a key keeps at most
`per_owner` ids (its oldest go first), and the oldest entries of all go first past `size`. It
lives beside the fleet, not in it, so a reload keeps it; a replica the new table removed simply
no longer answers for its ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from gateway.errors import NotFound
from gateway.types import Scope

MAX_ID = 128


@dataclass(frozen=True, slots=True)
class Owner:
    """Who a request is, for what the gateway keeps on a key's behalf (stored answers here, MCP
    sessions in mcp/sessions.py): `key` is `key:NAME` for a named key, `anon:DIGEST` for a plain
    key (a prefix of its SHA-256, never the key), `open` on a gateway without keys. An admin sees
    and may end what any key holds. edge/auth.py puts one in every request's scope."""

    key: str
    admin: bool = False

    @staticmethod
    def of(scope: Scope) -> Owner:
        found = scope.get("gateway.owner")
        return found if isinstance(found, Owner) else NOBODY


OPEN_OWNER = Owner("open", admin=True)  # a gateway without keys: one local user (edge/auth.py)
NOBODY = Owner("nobody")  # a scope the key check never saw: owns nothing, sees nothing


class Where(NamedTuple):
    """The preset and replica that hold a stored Responses answer."""

    preset: str
    replica: str


class StoredResponses:
    """id -> (preset, replica, owner), in the order the ids were last written."""

    def __init__(self, size: int = 20_000, per_owner: int = 2_000) -> None:
        self._size = size
        self._per_owner = per_owner
        self._where: OrderedDict[str, tuple[Where, str]] = OrderedDict()
        self._owned: dict[str, OrderedDict[str, None]] = {}  # owner key -> its ids, oldest first

    def remember(self, response_id: str, preset: str, replica: str, owner: Owner = OPEN_OWNER) -> None:
        """Records that `replica` of `preset` holds the stored answer `response_id`, on `owner`'s
        behalf; ignores an empty or overlong id and one another key already holds, and evicts the
        owner's oldest ids past `per_owner` and the oldest of all past `size`. Called by the proxy
        after each answer."""
        if not response_id or len(response_id) > MAX_ID:
            return
        previous = self._where.get(response_id)
        if previous is not None and previous[1] != owner.key:
            # A replica reusing an id another key holds is not a way to take it over.
            return
        self._where[response_id] = (Where(preset, replica), owner.key)
        self._where.move_to_end(response_id)
        ids = self._owned.setdefault(owner.key, OrderedDict())
        ids[response_id] = None
        ids.move_to_end(response_id)
        while len(ids) > self._per_owner:
            oldest, _ = ids.popitem(last=False)
            self._where.pop(oldest, None)
        while len(self._where) > self._size:
            oldest, (_, key) = self._where.popitem(last=False)
            self._drop_owned(key, oldest)

    def find(self, response_id: str, owner: Owner = OPEN_OWNER) -> Where | None:
        """Where the answer is, for its own key or an admin; None for anyone else, as for an id
        the gateway never saw."""
        entry = self._where.get(response_id) if len(response_id) <= MAX_ID else None
        if entry is None or not (owner.admin or entry[1] == owner.key):
            return None
        return entry[0]

    def foreign(self, response_id: str, owner: Owner) -> bool:
        """The id is known and belongs to another key: a request naming it must not be sent to any
        replica (the replica would serve it), unlike an id the gateway never saw."""
        entry = self._where.get(response_id) if len(response_id) <= MAX_ID else None
        return entry is not None and not owner.admin and entry[1] != owner.key

    def refuse_foreign(self, body: Mapping[str, Any], owner: Owner) -> None:
        """Raises NotFound for a request that continues another key's stored answer: refused, not
        forwarded, since the replica would continue it for anyone."""
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and self.foreign(previous, owner):
            raise NotFound(
                "No stored response with this id is known to the gateway",
                code="response_not_found",
                param="previous_response_id",
            )

    def holder(self, body: Mapping[str, Any], preset: str, owner: Owner) -> str | None:
        """The replica of `preset` that holds the stored answer this request continues, if any."""
        previous = body.get("previous_response_id")
        where = self.find(previous, owner) if isinstance(previous, str) else None
        return where[1] if where is not None and where[0] == preset else None

    def forget(self, response_id: str, owner: Owner = OPEN_OWNER) -> None:
        entry = self._where.get(response_id)
        if entry is None or not (owner.admin or entry[1] == owner.key):
            return
        del self._where[response_id]
        self._drop_owned(entry[1], response_id)

    def owned(self, owner: Owner) -> int:
        return len(self._owned.get(owner.key, ()))

    def _drop_owned(self, key: str, response_id: str) -> None:
        ids = self._owned.get(key)
        if ids is not None:
            ids.pop(response_id, None)
            if not ids:
                del self._owned[key]

    def __len__(self) -> int:
        return len(self._where)
