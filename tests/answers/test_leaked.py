"""Tool calls written as text: each form local models write, found whole and as it streams, and
everything that is not a complete call of a declared tool left as the text it was."""

from __future__ import annotations

import orjson
import pytest

from gateway.answers.leaked import Call, Piece, Scanner, Tools, split

BASH = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
    "required": ["command"],
    "additionalProperties": False,
}
EDIT = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "replace_all": {"type": "boolean"},
        "edits": {"type": "array", "items": {"type": "object"}},
        "note": {"type": ["string", "null"]},
    },
    "required": ["path"],
}
TOOLS = Tools({"Bash": BASH, "Edit": EDIT, "now": {"type": "object", "properties": {}}})
LS = Call("Bash", '{"command":"ls -la"}')

FORMS = {
    "hermes": '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>',
    "hermes_string_arguments": '<tool_call>{"name": "Bash", "arguments": "{\\"command\\": \\"ls -la\\"}"}</tool_call>',
    "llama_parameters": '<tool_call>{"name": "Bash", "parameters": {"command": "ls -la"}}</tool_call>',
    "qwen3_coder": (
        "<tool_call>\n<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>"
    ),
    "qwen3_coder_unwrapped": "<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n</function>",
    "glm": "<tool_call>Bash\n<arg_key>command</arg_key>\n<arg_value>ls -la</arg_value>\n</tool_call>",
    "glm_inline": "<tool_call>Bash<arg_key>command</arg_key><arg_value>ls -la</arg_value></tool_call>",
    "bare_json": '{"name": "Bash", "arguments": {"command": "ls -la"}}',
    "fenced_json": '```json\n{"name": "Bash", "arguments": {"command": "ls -la"}}\n```',
}


def streamed(text: str, cuts: list[int], tools: Tools = TOOLS, limit: int | None = None) -> list[Piece]:
    scanner = Scanner(tools) if limit is None else Scanner(tools, limit)
    pieces: list[Piece] = []
    last = 0
    for cut in [*cuts, len(text)]:
        pieces += scanner.feed(text[last:cut])
        last = cut
    return pieces + scanner.end()


def joined(pieces: list[Piece]) -> tuple[str, list[Call]]:
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, Call)]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_local_models_write_is_read_as_the_call(form: str) -> None:
    assert split("I'll list the files.\n" + FORMS[form], TOOLS) == ("I'll list the files.\n", [LS])


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_call_split_at_every_position_reads_the_same(form: str) -> None:
    text = "Let me look.\n" + FORMS[form] + "\n"
    expected = ("Let me look.\n", [LS])
    for cut in range(len(text) + 1):
        assert joined(streamed(text, [cut])) == expected, cut
    assert joined(streamed(text, list(range(1, len(text))))) == expected  # one character at a time


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=now>\n</function>\n</tool_call>",
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "now"}</tool_call>',
        "<tool_call>now</tool_call>",
        '{"name": "now", "arguments": {}}',
    ],
)
def test_a_call_without_arguments_is_a_call_with_an_empty_object(text: str) -> None:
    assert split(text, TOOLS) == ("", [Call("now", "{}")])


def test_parallel_calls_come_out_in_order() -> None:
    two = FORMS["hermes"] + "\n" + "<tool_call>\n<function=now>\n</function>\n</tool_call>"
    assert split(two, TOOLS) == ("", [LS, Call("now", "{}")])
    bare = FORMS["bare_json"] + '\n{"name": "now", "arguments": {}}\n'
    assert split(bare, TOOLS) == ("", [LS, Call("now", "{}")])
    inside = "<tool_call>\n<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n"
    inside += "<function=now>\n</function>\n</tool_call>"
    assert split(inside, TOOLS) == ("", [LS, Call("now", "{}")])


def test_values_written_as_text_are_typed_by_the_tools_schema() -> None:
    text = (
        "<function=Edit>\n<parameter=path>\n007\n</parameter>\n<parameter=replace_all>\ntrue\n</parameter>\n"
        '<parameter=edits>\n[{"old": "a", "new": "b"}]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n'
        "</function>"
    )
    [call] = split(text, TOOLS)[1]
    assert orjson.loads(call.arguments) == {
        "path": "007",
        "replace_all": True,
        "edits": [{"old": "a", "new": "b"}],
        "note": "null",  # the schema's first type is string: the text as written
    }
    timed = "<function=Bash>\n<parameter=command>\nsleep 1\n</parameter>\n<parameter=timeout>\n5\n</parameter>\n</function>"
    assert orjson.loads(split(timed, TOOLS)[1][0].arguments) == {"command": "sleep 1", "timeout": 5}


def test_a_multi_line_value_keeps_its_lines() -> None:
    text = "<function=Bash>\n<parameter=command>\ncd /tmp\n\nls\n</parameter>\n</function>"
    assert split(text, TOOLS)[1] == [Call("Bash", '{"command":"cd /tmp\\n\\nls"}')]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "Unknown", "arguments": {}}</tool_call>',  # not a declared tool
        '<tool_call>{"name": "Bash", "arguments": {"cmd": "ls"}}</tool_call>',  # not its schema
        '<tool_call>{"name": "Bash", "arguments": {"command": 5}}</tool_call>',
        '<tool_call>{"name": "Bash", "arguments": ["ls"]}</tool_call>',
        '<tool_call>{"name": "Bash", "arguments": {"command": "ls"}</tool_call>',  # broken JSON
        '<tool_call>{"name": "Bash", "arguments": {"command": "ls"',  # cut off
        "<tool_call>\n<function=Bash>\n<parameter=command>\nls",  # cut off
        "<function=Bash>\n<parameter=command>\nls\n</parameter>\n",  # never closed
        "<tool_call>Bash\n<arg_key>command</arg_key>\n<arg_value>ls",  # cut off
        "<function=Bash>\nls -la\n</function>",  # no parameter
        '{"name": "Bash", "arguments": {"command": "ls"}',  # cut off
        '```json\n{"name": "Bash", "arguments": {"command": "ls"}}\n``` and then some',
        'Call it like {"name": "Bash", "arguments": {"command": "ls"}} in your code.',  # mid-line
        '{"name": "Bash", "arguments": {"command": "ls"}}\nThat is how it looks.',  # prose after
        '{"name": "Bash", "arguments": {"command": "ls"}, "extra": 1}',
        "Use the <tool_call> tags to call Bash.",
    ],
)
def test_what_is_not_a_complete_call_of_a_declared_tool_stays_text(text: str) -> None:
    assert split(text, TOOLS) == (text, [])
    for cut in range(len(text) + 1):
        assert joined(streamed(text, [cut])) == (text, []), cut


def test_prose_that_names_a_tool_streams_as_it_comes() -> None:
    scanner = Scanner(TOOLS)
    words = ["I will ", "call the Bash ", "tool with ", "command ls ", "to list\n", "the files.\n", "Done."]
    for word in words:
        assert scanner.feed(word) == [word]
    assert scanner.end() == []


def test_text_is_held_only_from_a_calls_opening_marker() -> None:
    scanner = Scanner(TOOLS)
    assert scanner.feed("Let me check. ") == ["Let me check. "]
    assert scanner.feed("<tool") == []  # may open a call
    assert scanner.feed("_call>\n<function=Bash>") == []
    assert scanner.feed("\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>") == [LS]
    assert scanner.end() == []
    scanner = Scanner(TOOLS)
    assert scanner.feed("a <b> tag and x < y") == ["a <b> tag and x < y"]
    assert scanner.feed("{ not at a line start") == ["{ not at a line start"]
    assert scanner.feed("\n{") == ["\n"]  # a brace that starts a line may open a bare call
    assert scanner.feed('"key": 1}') == ['{"key": 1}']


def test_text_after_a_call_goes_out_as_text() -> None:
    text = FORMS["hermes"] + "\n\nI have asked for the listing."
    assert split(text, TOOLS) == ("\n\nI have asked for the listing.", [LS])


def test_what_is_held_is_bounded_and_given_back_as_text() -> None:
    long = '<tool_call>{"name": "Bash", "arguments": {"command": "' + "x" * 500 + '"}}</tool_call>'
    scanner = Scanner(TOOLS, limit=100)
    out = scanner.feed(long[:90])
    assert out == []
    out += scanner.feed(long[90:200])
    assert "".join(p for p in out if isinstance(p, str)) == long[:200]  # past the limit: text
    out += scanner.feed(long[200:]) + scanner.end()
    assert joined(out) == (long, [])


def test_a_qwen3_coder_call_cut_before_its_closing_tag_is_taken_at_the_end() -> None:
    text = "<tool_call>\n<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n"
    assert split(text, TOOLS) == ("", [LS])


def test_without_declared_tools_nothing_is_a_call() -> None:
    assert split(FORMS["hermes"], Tools({})) == (FORMS["hermes"], [])


def test_a_bare_calls_strings_may_hold_braces_quotes_and_backslashes() -> None:
    text = '{"name": "Bash", "arguments": {"command": "echo \\"}\\" \\\\ {[\\\\\\""}}'
    expected = ("", [Call("Bash", '{"command":"echo \\"}\\" \\\\ {[\\\\\\""}')])
    assert orjson.loads(text)["arguments"]["command"] == 'echo "}" \\ {[\\"'
    for cut in range(len(text) + 1):
        assert joined(streamed(text, [cut])) == expected, cut
    assert joined(streamed(text, list(range(1, len(text))))) == expected


def test_a_long_call_fed_a_few_characters_at_a_time_is_read_whole() -> None:
    content = "line\n" * 40_000
    text = "<function=Bash>\n<parameter=command>\n" + content + "\n</parameter>\n</function>"
    pieces = streamed(text, list(range(3, len(text), 3)))
    assert joined(pieces) == ("", [Call("Bash", orjson.dumps({"command": content}).decode())])
