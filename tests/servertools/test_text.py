"""gateway/servertools/text.py: a fetched page as text for the model: HTML reduced to its readable
text and title, the text bounded, the charset read from the content type, and which content types
count as text at all."""

from __future__ import annotations

import pytest

from gateway.servertools.text import _Text, charset, decode, html_text, is_text, page_text

PAGE = """<!doctype html>
<html>
<head>
  <title>  The   Page
  Title </title>
  <style>body { color: red }</style>
  <script>var secret = "not text";</script>
</head>
<body>
  <h1>Heading</h1>
  <p>First    paragraph
     continues here.</p>
  <noscript>enable javascript</noscript>
  <ul><li>one</li><li>two</li></ul>
  <svg><text>drawn words</text></svg>
  <p>Fish &amp; chips &lt;3</p>
</body>
</html>
"""


def test_html_becomes_its_readable_text_and_its_title() -> None:
    title, text = html_text(PAGE, 10_000)
    assert title == "The Page Title"  # blank space in the title collapses to single spaces
    assert text == "Heading\n\nFirst paragraph\ncontinues here.\n\none\n\ntwo\n\nFish & chips <3"


@pytest.mark.parametrize(
    "hidden",
    [
        "<script>alert(1)</script>",
        "<style>p { margin: 0 }</style>",
        "<noscript>enable javascript</noscript>",
        "<template><p>later</p></template>",
        "<svg><text>drawn</text></svg>",
        "<iframe>framed</iframe>",
        "<object>embedded</object>",
    ],
    ids=["script", "style", "noscript", "template", "svg", "iframe", "object"],
)
def test_content_that_is_not_read_as_text_is_skipped(hidden: str) -> None:
    _, text = html_text(f"<p>before</p>{hidden}<p>after</p>", 10_000)
    assert text == "before\n\nafter"


def test_nested_skipped_elements_skip_until_the_outer_one_ends() -> None:
    html = "<p>a</p><svg><svg><text>inner</text></svg><text>outer</text></svg><p>b</p>"
    assert html_text(html, 10_000)[1] == "a\n\nb"


def test_an_end_tag_without_its_start_does_not_unskip_anything_else() -> None:
    html = "</script><p>shown</p><script>hidden</script><p>also shown</p>"
    assert html_text(html, 10_000)[1] == "shown\n\nalso shown"


def test_block_elements_end_a_line_and_inline_ones_do_not() -> None:
    html = "<div>one <b>bold</b> <a href='x'>link</a></div><div>two<br>three</div>"
    # A block between its start and end tags is a paragraph; a lone <br> one line break.
    assert html_text(html, 10_000)[1] == "one bold link\n\ntwo\nthree"


def test_runs_of_blank_lines_collapse_to_one() -> None:
    html = "<p>a</p>\n\n\n\n<div></div><div></div><p>b</p>"
    assert html_text(html, 10_000)[1] == "a\n\nb"


def test_spaces_inside_pre_are_kept() -> None:
    html = "<p>x    y</p><pre>a    b\tc</pre>"
    assert html_text(html, 10_000)[1] == "x y\n\na    b\tc"


def test_code_in_pre_keeps_its_indentation() -> None:
    _, text = html_text("<p>  intro  </p><pre>def f():\n    if x:\n        return 1\n</pre>", 1000)
    assert text == "intro\n\ndef f():\n    if x:\n        return 1"


def test_a_page_cannot_mark_its_own_lines_to_keep_their_spaces() -> None:
    _, text = html_text("<p>\x00   indented?</p>", 1000)
    assert text == "indented?"


def test_the_title_is_bounded_whatever_the_page_sends() -> None:
    title, _ = html_text("<title>" + "a" * 10_000 + "</title><p>hi</p>", 1000)
    assert title == "a" * 300


def test_the_text_is_cut_at_the_limit() -> None:
    html = "<p>" + "word " * 1000 + "</p>"
    _, text = html_text(html, 50)
    assert len(text) == 50 and text.startswith("word word")


def test_text_past_the_limit_is_not_collected() -> None:
    # Memory stays bounded by the limit however long the page: once the limit is reached, later
    # parts are never kept (the parser is private; what it holds is the bound itself).
    parser = _Text(100)
    parser.feed("<p>" + "a" * 100 + "</p>" + "<p>" + "b" * 10_000 + "</p>" * 1000)
    parser.close()
    assert "".join(parser.parts).strip() == "a" * 100
    assert html_text("<p>" + "a" * 100 + "</p><p>" + "b" * 10_000 + "</p>", 100)[1] == "a" * 100


def test_a_page_without_a_title_has_an_empty_one() -> None:
    assert html_text("<p>hi</p>", 100) == ("", "hi")


def test_title_text_is_not_repeated_in_the_body_text() -> None:
    assert html_text("<title>Name</title><p>body</p>", 100) == ("Name", "body")


# --- the charset and the content type ----------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("text/html; charset=ISO-8859-1", "iso-8859-1"),
        ('text/html; charset="Shift_JIS"', "shift_jis"),
        ("text/plain;CHARSET=utf-16", "utf-16"),
        ("text/html; boundary=x; charset=latin-1", "latin-1"),
        ("text/html", "utf-8"),
        ("text/html; charset=", "utf-8"),
        ("", "utf-8"),
    ],
)
def test_the_charset_is_read_from_the_content_type_else_utf_8(content_type: str, expected: str) -> None:
    assert charset(content_type) == expected


def test_a_body_is_decoded_in_its_charset() -> None:
    assert decode("café".encode("latin-1"), "text/plain; charset=latin-1") == "café"


def test_an_unknown_charset_falls_back_to_utf_8() -> None:
    assert decode("café".encode(), "text/plain; charset=no-such-charset") == "café"


def test_bytes_that_do_not_decode_are_replaced_not_refused() -> None:
    assert decode(b"ok \xff\xfe", "text/plain") == "ok \ufffd\ufffd"


@pytest.mark.parametrize(
    "content_type",
    [
        "text/html",
        "TEXT/HTML; charset=utf-8",
        "text/plain",
        "text/markdown",
        "application/json",
        "application/xml",
        "application/xhtml+xml",
        "application/javascript",
        "",  # no type said: the body is looked at
    ],
)
def test_text_types_are_read(content_type: str) -> None:
    assert is_text(content_type)


@pytest.mark.parametrize(
    "content_type", ["image/png", "application/pdf", "application/octet-stream", "video/mp4", "font/woff2"]
)
def test_other_types_are_not_read(content_type: str) -> None:
    assert not is_text(content_type)


# --- a fetched body -------------------------------------------------------------------------------


def test_an_html_body_is_reduced_to_text() -> None:
    body = "<html><title>T</title><p>caf\u00e9</p></html>".encode("latin-1")
    assert page_text(body, "text/html; charset=latin-1", 100) == ("T", "café")


def test_an_xhtml_body_is_reduced_to_text() -> None:
    body = b'<html xmlns="http://www.w3.org/1999/xhtml"><title>X</title><p>y</p></html>'
    assert page_text(body, "application/xhtml+xml", 100) == ("X", "y")


def test_an_untyped_body_that_looks_like_html_is_reduced_to_text() -> None:
    assert page_text(b"<!doctype html><HTML><p>hi</p></HTML>", "", 100) == ("", "hi")


def test_other_text_is_given_as_it_is_cut_at_the_limit() -> None:
    body = b'{"key": "<p>not html</p>"}' + b" " * 100
    assert page_text(body, "application/json", 26) == ("", '{"key": "<p>not html</p>"}')
    assert page_text(b"line one\n\n\n  line two", "text/plain", 100) == ("", "line one\n\n\n  line two")


def test_an_untyped_body_without_html_is_given_as_it_is() -> None:
    assert page_text(b"just <b>words</b>", "", 100) == ("", "just <b>words</b>")
