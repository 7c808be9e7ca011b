"""A fetched page as text for the model: HTML reduced to its readable text, bounded.

The standard library's HTML parser is lenient and never fetches anything the page names; scripts,
styles and the like are skipped, block elements end a line, runs of blank space collapse.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

_SKIP = frozenset({"script", "style", "noscript", "template", "svg", "head", "iframe", "object"})
_BLOCK = frozenset(
    {
        "p",
        "div",
        "br",
        "li",
        "tr",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "pre",
        "section",
        "article",
        "header",
        "footer",
        "table",
        "ul",
        "ol",
        "blockquote",
        "hr",
        "dd",
        "dt",
    }
)
_SPACES = re.compile(r"[ \t\r\f\v]+")
_LINES = re.compile(r"\n\s*\n+")
_KEEP = "\x00"  # marks a line from <pre>; removed from the page's own text first
TITLE_LIMIT = 300
TEXT_TYPES = (
    "text/",
    "application/json",
    "application/xml",
    "application/xhtml+xml",
    "application/javascript",
)


class _Text(HTMLParser):
    def __init__(self, limit: int) -> None:
        super().__init__(convert_charrefs=True)
        self.limit = limit
        self.parts: list[str] = []
        self.size = 0
        self.skipping = 0
        self.in_title = False
        self.title = ""
        self.in_pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIP and tag != "head":
            self.skipping += 1
        if tag == "title":
            self.in_title = True
        if tag == "pre":
            self.in_pre += 1
        if tag in _BLOCK:
            self._add("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP and tag != "head" and self.skipping:
            self.skipping -= 1
        if tag == "title":
            self.in_title = False
        if tag == "pre" and self.in_pre:
            self.in_pre -= 1
        if tag in _BLOCK:
            self._add("\n")

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title += data[: TITLE_LIMIT - len(self.title)]
            return
        if self.skipping:
            return
        data = data.replace(_KEEP, "")
        if self.in_pre:  # code keeps its indentation: each of its lines is marked to stay unstripped
            self._add(_KEEP + data.replace("\n", "\n" + _KEEP))
        else:
            self._add(_SPACES.sub(" ", data))

    def _add(self, text: str) -> None:
        if self.size < self.limit:
            self.parts.append(text)
            self.size += len(text)


def html_text(html: str, limit: int) -> tuple[str, str]:
    """(title, text) of an HTML page, the text at most `limit` characters (before the cut is said)."""
    parser = _Text(limit)
    parser.feed(html)
    parser.close()
    lines = "".join(parser.parts).split("\n")
    text = _LINES.sub("\n\n", "\n".join(_line(line) for line in lines))
    return " ".join(parser.title.split()), text.strip()[:limit]


def _line(line: str) -> str:
    if line.startswith(_KEEP):
        return line.replace(_KEEP, "").rstrip()
    return line.replace(_KEEP, "").strip()


def charset(content_type: str) -> str:
    for piece in content_type.split(";")[1:]:
        key, _, value = piece.strip().partition("=")
        if key.lower() == "charset" and value:
            return value.strip("\"' ").lower()
    return "utf-8"


def decode(body: bytes, content_type: str) -> str:
    try:
        return body.decode(charset(content_type), "replace")
    except LookupError:
        return body.decode("utf-8", "replace")


def is_text(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return not media or media.startswith(TEXT_TYPES)


def page_text(body: bytes, content_type: str, limit: int) -> tuple[str, str]:
    """(title, text) of a fetched body: HTML reduced to text, other text types as they are."""
    raw = decode(body, content_type)
    media = content_type.split(";", 1)[0].strip().lower()
    if media in ("text/html", "application/xhtml+xml") or (not media and "<html" in raw[:1000].lower()):
        return html_text(raw, limit)
    return "", raw[:limit]
