"""report.html rendered again from what a reproduction left on disk, without running it again:
``python -m analysis.rerender DIR [DIR ...]``.

A directory holding ``report.md`` (what `tangram reproduce` writes beside report.html, with
``figures/``) is rendered with :func:`analysis.report_html.markdown_to_html`, as the command
does. A directory holding only a report.html of the first renderer (docs/evidence/quick and
full: a line-by-line renderer that printed inline Markdown raw, ``**`` and backticks) gets its
Markdown back from that page, which that renderer wrote one Markdown line per element
(headings, paragraphs, list items, table rows, images as data: URIs), and is rendered from it,
in the order `tangram reproduce` writes a report today: the figures right after the verdicts,
each with its note. The text and the figures are the page's own: nothing is measured or
drawn again."""

from __future__ import annotations

import argparse
import base64
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

from analysis.report_html import STYLE, markdown_to_html
from analysis.reproduce import FIGURE_NOTES

#: the first renderer's stylesheet: a page carrying it was written by that renderer
FIRST_STYLE = ("body{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}"
               "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
               "padding:3px 6px}img{max-width:100%}")
#: the verdicts' section (analysis.reproduce.verdict_lines): the figures follow it
VERDICTS = "## Where the paper's number is not reproduced, and why"
FIGURES = "## Figures"
DATA_PNG = "data:image/png;base64,"


class _FirstPage(HTMLParser):
    """The Markdown lines a first-renderer page was written from, and its images."""

    BLOCKS = {"h1", "h2", "h3", "h4", "h5", "h6", "p", "li", "th", "td"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = []
        self.images: dict[str, bytes] = {}
        self.text: list[str] | None = None
        self.row: list[str] | None = None
        self.header = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.BLOCKS:
            self.text = []
        elif tag == "tr":
            self.row = []
        elif tag == "img":
            a = dict(attrs)
            alt, src = a.get("alt") or "", a.get("src") or ""
            if not (alt.startswith("figures/") and src.startswith(DATA_PNG)):
                raise ValueError(f"an image this page's renderer did not write: {alt!r}")
            self.images[alt] = base64.b64decode(src[len(DATA_PNG):])
            self.lines += [f"![{Path(alt).stem}]({alt})", ""]
        elif tag not in {"html", "head", "meta", "title", "style", "body", "table", "ul"}:
            raise ValueError(f"<{tag}>: not a tag of the first renderer's pages")

    def handle_data(self, data: str) -> None:
        if self.text is not None:
            self.text.append(data)

    def handle_endtag(self, tag: str) -> None:
        text = "".join(self.text or [])
        if tag in {"th", "td"}:
            assert self.row is not None
            self.row.append(text)
            self.header = tag == "th"
        elif tag == "tr":
            assert self.row is not None
            self.lines.append("| " + " | ".join(self.row) + " |")
            if self.header:  # the separator line that renderer skipped
                self.lines.append("| " + " | ".join("---" for _ in self.row) + " |")
            self.row = None
        elif tag == "li":
            self.lines.append(f"* {text}")
        elif tag in {"table", "ul"}:
            self.lines.append("")
        elif tag[0] == "h" and tag[1:].isdigit():
            self.lines += ["#" * int(tag[1:]) + " " + text, ""]
        elif tag == "p" and text:
            self.lines += [text, ""]
        if tag in self.BLOCKS:
            self.text = None


def _sections(lines: list[str]) -> list[list[str]]:
    """``lines`` cut before each heading."""
    out: list[list[str]] = [[]]
    for line in lines:
        if line.startswith("#") and out[-1]:
            out.append([])
        out[-1].append(line)
    return out


def first_page_markdown(page: str) -> tuple[str, dict[str, bytes]]:
    """The Markdown of a first-renderer report.html, in today's order, and its figures (by
    their path in the Markdown, ``figures/NAME.png``)."""
    if FIRST_STYLE not in page:
        raise ValueError("not a page of the first report renderer (its stylesheet is missing)")
    parser = _FirstPage()
    parser.feed(page)
    parser.close()
    sections = _sections(parser.lines)
    heads = [s[0] for s in sections]
    if VERDICTS not in heads or FIGURES not in heads:
        raise ValueError(f"the page has no {VERDICTS!r} or {FIGURES!r} section")
    figures = sections.pop(heads.index(FIGURES))
    with_notes: list[str] = []
    for line in figures:
        with_notes.append(line)
        for stem, note in FIGURE_NOTES.items():
            if line.startswith(f"![{stem}](") and note not in figures:
                with_notes += ["", note]
    at = [s[0] for s in sections].index(VERDICTS) + 1
    sections.insert(at, with_notes)
    return "\n".join(line for s in sections for line in s), parser.images


def rerender(directory: Path) -> bool:
    """``directory``/report.html written again by today's renderer: True, or False where
    the page has no report.md beside it and today's renderer wrote it already."""
    page_path, md_path = directory / "report.html", directory / "report.md"
    if md_path.exists():
        page_path.write_text(markdown_to_html(md_path.read_text(), directory))
        return True
    if not page_path.exists():
        raise FileNotFoundError(f"{directory}: neither report.md nor report.html")
    old = page_path.read_text()
    if f"<style>{STYLE}</style>" in old:
        return False
    md, images = first_page_markdown(old)
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in images.items():
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / name).write_bytes(data)
        page = markdown_to_html(md, Path(tmp))
    missing = [n for n in images if Path(n).stem not in page]
    if missing or page.count(DATA_PNG) != len(images):
        raise ValueError(f"{directory}: figures lost on the way: {missing}")
    page_path.write_text(page)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.rerender", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR",
                        help="a reproduction's directory (report.md, or a first-renderer "
                             "report.html)")
    for directory in parser.parse_args(argv).dirs:
        try:
            done = rerender(directory)
        except (OSError, ValueError) as e:
            print(f"{directory}: {e}", file=sys.stderr)
            return 1
        print(f"wrote {directory / 'report.html'}" if done else
              f"{directory / 'report.html'}: rendered by today's renderer already, left as it is")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
