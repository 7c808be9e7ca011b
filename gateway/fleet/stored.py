"""Where each stored Responses answer lives: a stored response exists on the one replica that
produced it, so `GET`/`DELETE /v1/responses/{id}`, `.../cancel` and a later request with
`previous_response_id` must reach that replica.

Bounded whatever clients send: ids longer than `MAX_ID` are never stored, and the oldest entries
go first past `size`. It lives beside the fleet, not in it, so a reload keeps it; a replica the
new table removed simply no longer answers for its ids.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_ID = 128


class StoredResponses:
    def __init__(self, size: int = 20_000) -> None:
        self._size = size
        self._where: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (preset, replica)

    def remember(self, response_id: str, preset: str, replica: str) -> None:
        if not response_id or len(response_id) > MAX_ID:
            return
        self._where[response_id] = (preset, replica)
        self._where.move_to_end(response_id)
        while len(self._where) > self._size:
            self._where.popitem(last=False)

    def find(self, response_id: str) -> tuple[str, str] | None:
        return self._where.get(response_id) if len(response_id) <= MAX_ID else None

    def forget(self, response_id: str) -> None:
        self._where.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._where)
