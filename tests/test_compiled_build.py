"""The rules the compiled request path keeps (setup.py compiles it with mypyc for the Docker image;
scripts/test-compiled runs the tests against it).

mypyc, on the version the image builds with, loses track of a coroutine's exception state across
an `await` that suspends inside an `except` or `finally` block: an exception raised in the `try`
is swallowed, or one that was caught and handled further down comes back out (both reproduced on
small examples; DESIGN.md, "The compiled build"). The compiled modules therefore never await
there: the exception is kept in a variable, the cleanup awaited after the block, and the exception
raised again. These tests read the sources, so they hold in the pure-Python checkout too.
"""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compiled_modules() -> list[Path]:
    patterns = runpy.run_path(str(ROOT / "setup.py"), run_name="setup_list")["COMPILED"]
    assert isinstance(patterns, tuple)
    found = []
    for pattern in patterns:
        matched = sorted(ROOT.glob(pattern))
        assert matched, f"setup.py compiles {pattern}, which names no file"
        found.extend(matched)
    return found


def awaits_in(nodes: list[ast.stmt]) -> list[int]:
    """Lines of the awaits (`await`, `async with`, `async for`) in these statements, not counting
    functions defined there (they run elsewhere)."""
    lines: list[int] = []
    stack: list[ast.AST] = list(nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.Await | ast.AsyncWith | ast.AsyncFor):
            lines.append(node.lineno)
        stack.extend(ast.iter_child_nodes(node))
    return sorted(lines)


def test_the_compiled_modules_never_await_in_an_except_or_finally_block() -> None:
    found = []
    for path in compiled_modules():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Try | ast.TryStar):
                blocks = [("finally", node.finalbody)] + [("except", h.body) for h in node.handlers]
                for kind, body in blocks:
                    found += [f"{path.relative_to(ROOT)}:{line} awaits in {kind}" for line in awaits_in(body)]
    assert not found, "\n".join(found)


def test_the_check_sees_an_await_in_either_block() -> None:
    """The scan itself: it finds what it looks for, and not an await in a function defined there."""
    tree = ast.parse(
        "async def f():\n"
        "    try:\n"
        "        await a()\n"
        "    except E:\n"
        "        async with b():\n"
        "            pass\n"
        "    finally:\n"
        "        async def later():\n"
        "            await c()\n"
        "        await d()\n"
    )
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.Try)]
    assert awaits_in(node.body) == [3]
    assert awaits_in(node.handlers[0].body) == [5]
    assert awaits_in(node.finalbody) == [10]


def test_the_compiled_list_names_the_request_path() -> None:
    compiled = {str(p.relative_to(ROOT)) for p in compiled_modules()}
    for module in ("gateway/pipeline/proxy.py", "gateway/relay/stream.py", "gateway/upstream/lean_client.py"):
        assert module in compiled
    # A compiled class cannot subclass an interpreted one: the edge's protocol (a uvicorn
    # subclass) and the pydantic models stay out.
    for module in ("gateway/edge/connection.py", "gateway/routing/table.py", "gateway/team/keys.py"):
        assert module not in compiled
