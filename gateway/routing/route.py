"""Which preset serves a request: the model name, an alias or pattern, the task, images, and what
the endpoint needs (pure; the table's `resolve` does the naming, this adds the endpoint).

An endpoint is served by a preset that has its capability (embeddings, rerank) and at least one
engine that serves its path (dialects/registry.py). A request that named its model or task and
landed on a preset without them is told which presets would serve it; one that named nothing goes
to the first preset that serves the endpoint.
"""

from __future__ import annotations

from typing import Any

from gateway.dialects.registry import Endpoint
from gateway.errors import BadRequest
from gateway.routing.table import Preset, Route, Table


def requested_task(body: dict[str, Any], header: str | None) -> str | None:
    """The task a request names: the body's `task` field, else the `x-task` header."""
    task = body.get("task", header)
    if task is not None and not isinstance(task, str):
        raise BadRequest("'task' must be a string", param="task")
    return task


def serves(preset: Preset, endpoint: Endpoint) -> bool:
    """The preset has the endpoint's capability and an engine that serves its path."""
    if endpoint.needs is not None and not getattr(preset, endpoint.needs):
        return False
    engines = preset.engines
    return not engines or any(engine in endpoint.upstream for engine in engines)


def route(
    table: Table, endpoint: Endpoint, body: dict[str, Any], task_header: str | None, image_parts: bool = True
) -> Route:
    """Model, alias or pattern, else task, else the default; images to vision; then a preset with
    the capability and an engine that serves the endpoint. `image_parts` False: the body's walk
    saw no part naming an image type, so the scan for one is skipped."""
    model = body.get("model")
    task = requested_task(body, task_header)
    found = table.resolve(model, task, image_parts and endpoint.dialect.has_images(body))
    if serves(found.preset, endpoint):
        return found
    # Only on a miss: the scan of every preset stays off the common path.
    able = [p for p in table.presets.values() if serves(p, endpoint)]
    chosen = (model is not None and model != "auto") or task is not None
    if chosen or not able:
        names = ", ".join(p.name for p in able) or "none"
        raise BadRequest(
            f"Preset '{found.preset.name}' does not serve {endpoint.path}; presets that do: {names}",
            code="endpoint_not_served",
        )
    return Route(able[0], "capability")
