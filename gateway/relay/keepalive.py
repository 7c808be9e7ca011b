"""A streaming client kept connected while its request waits: in the preset's queue, for a launched
replica to load, or for a long prefill before the first token.

Agents built for hosted models give up on silence (Claude Code after about 300 s without a byte,
Codex after its stream idle timeout) and then send the same request again, so the fleet does the
work twice. After `after` seconds without an answer the gateway opens the stream itself in the
dialect's terms (`message_start`, `response.created`; for chat the status line) and writes the
dialect's keep-alive every `every` seconds until the replica's first event arrives; the replica's
own opening events are then dropped (answers/splice.py).

Most requests never wait that long: until the first timer fires there is only a timer handle (no
task), so a quick answer pays for one `call_later` and its cancellation.
"""

from __future__ import annotations

import asyncio

from gateway.relay.respond import Responder

KEEPALIVE_AFTER = 1.5  # seconds of waiting before the stream is opened
# Under Claude Code's shortest idle limit (10 s) with room; Anthropic itself pings every 10-15 s.
KEEPALIVE_EVERY = 5.0


class KeepAlive:
    """Runs beside a waiting streaming request; `stop()` before the replica's stream is written."""

    def __init__(
        self, responder: Responder, after: float = KEEPALIVE_AFTER, every: float = KEEPALIVE_EVERY
    ) -> None:
        self.responder, self.every = responder, every
        self.beats = 0
        loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = loop.call_later(after, self._begin)

    def _begin(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        responder = self.responder
        async with responder.writing:
            await responder.open_stream()
        while True:
            await asyncio.sleep(self.every)
            async with responder.writing:
                if not responder.opened:
                    return
                await responder.body(responder.dialect.keepalive())
                self.beats += 1

    async def stop(self) -> None:
        """Ends the keep-alive; a write in progress finishes first, so no event is cut in half."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task, self._task = self._task, None
        if task is None:
            return
        async with self.responder.writing:
            task.cancel()
        # Waited for, not awaited: its cancellation is not raised here only to be suppressed. Compiled
        # (mypyc), such a suppressed exception once came back out of a caller (DESIGN.md).
        await asyncio.wait((task,))
        if not task.cancelled():
            task.result()  # a write that failed fails here, as before
