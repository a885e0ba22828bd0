"""report.md rendered as one self-contained report.html (figures inlined).

A real CommonMark renderer (markdown-it-py, with its table extension) rather than a
line-by-line one: the report's cells and notes carry inline Markdown (``**bold**``,
backticks, links) that a hand-written renderer printed raw."""

from __future__ import annotations

import base64
from pathlib import Path

from markdown_it import MarkdownIt
from markdown_it.token import Token

STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222;"
         "line-height:1.45}table{border-collapse:collapse;font-size:13px;margin:1em 0}"
         "td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}"
         "th{background:#f3f3f3}code{background:#f5f5f5;padding:0 2px}img{max-width:100%}")


def _inline_images(tokens: list[Token], root: Path) -> None:
    """Every local image becomes a data: URI, so the page is one file a user can mail."""
    for token in tokens:
        for child in token.children or ():
            if child.type != "image":
                continue
            src = str(child.attrGet("src") or "")
            path = root / src
            if src and "://" not in src and path.is_file():
                data = base64.b64encode(path.read_bytes()).decode()
                child.attrSet("src", f"data:image/png;base64,{data}")


def markdown_to_html(md: str, root: Path, title: str = "Tangram reproduction") -> str:
    """``md`` as a standalone HTML page; images are read relative to ``root``."""
    renderer = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = renderer.parse(md)
    _inline_images(tokens, root)
    body = renderer.renderer.render(tokens, renderer.options, {})
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>\n")
