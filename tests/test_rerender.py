"""report.html rendered again without running the reproduction (analysis/rerender.py): from
report.md where a run left one, and from a page of the first renderer (which printed inline
Markdown raw) where only that page is on record, as in docs/evidence/quick and full. The
shipped pages are checked to be rendered."""

from __future__ import annotations

import base64
import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.report_html import markdown_to_html
from analysis.reproduce import FIGURE_NOTES
from analysis.rerender import first_page_markdown, main, rerender

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "docs" / "evidence" / name for name in ("quick", "full")]

#: a report as analysis.reproduce.report() wrote it before the figures moved up
MD_BEFORE = """# Tangram reproduction (quick)

Cluster 'default' (see `sim/clusters/default.yaml`): best *for that row's metric* & <b>not a tag</b>.

## Headline figures

| figure | paper | ours | note |
| --- | --- | --- | --- |
| coding mean ACT | 4.3 | 2.4 | **bold** and `code`, 1 < 2 |
| reward | - | n/a | - |

## Where the paper's number is not reproduced, and why

* **coding mean ACT**: paper 4.3x, ours 2.4x: **not reproduced**: ours is smaller.
* **reward**: reproduced (the paper's value lies in our interval).

Regret matrix (docs/evidence/regret.json, scale quick, 288 cells): 0 pairs.

### The lead point of each assumption, and why

| assumption | lead | rows | source |
| --- | --- | --- | --- |
| pod_cores | 4 | coding mean ACT | assumption |

## Figures

Dashed red lines mark the paper's values.

![fig6_act](figures/fig6_act.png)

![sweep_pod_size](figures/sweep_pod_size.png)

## Trace parameters and sources

Sizes: base=default, seeds=5
"""
#: the same report in the order report() writes today, the figure's note after it
MD_NOW = MD_BEFORE.replace(
    "## Figures\n\nDashed red lines mark the paper's values.\n\n![fig6_act](figures/fig6_act.png)"
    "\n\n![sweep_pod_size](figures/sweep_pod_size.png)\n\n", "").replace(
    "### The lead point", "## Figures\n\nDashed red lines mark the paper's values.\n\n"
    f"![fig6_act](figures/fig6_act.png)\n\n{FIGURE_NOTES['fig6_act']}\n\n"
    "![sweep_pod_size](figures/sweep_pod_size.png)\n\n### The lead point")
FIGURES = {"figures/fig6_act.png": b"\x89PNG fig6 bytes", "figures/sweep_pod_size.png": b"\x89PNG pod"}


def first_renderer(md: str, root: Path) -> str:
    """The first renderer of report.html (analysis/reproduce.py before markdown-it-py),
    verbatim: one element per Markdown line, inline Markdown printed as text."""
    body: list[str] = []
    in_table = False
    in_list = False
    for line in md.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("- "):
                continue
            tag = "th" if not in_table else "td"
            if not in_table:
                body.append("<table>")
                in_table = True
            body.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
            continue
        if in_table:
            body.append("</table>")
            in_table = False
        if line.startswith("* "):
            if not in_list:
                body.append("<ul>")
                in_list = True
            body.append(f"<li>{html.escape(line[2:])}</li>")
            continue
        if in_list:
            body.append("</ul>")
            in_list = False
        if line.startswith("!["):
            src = line[line.index("(") + 1: line.rindex(")")]
            data = base64.b64encode((root / src).read_bytes()).decode()
            body.append(f'<p><img alt="{html.escape(src)}" src="data:image/png;base64,{data}"></p>')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    if in_table:
        body.append("</table>")
    style = ("body{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
             "padding:3px 6px}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Tangram reproduction"
            f"</title><style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def _with_figures(directory: Path) -> Path:
    for name, data in FIGURES.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


def raw_markdown(page: str) -> list[str]:
    """Markdown a reader would see printed in ``page``: ``**`` or backticks in its text,
    outside <code> and <pre> (the figures' data: URIs aside)."""
    body = re.sub(r'src="data:[^"]*"', "", page)
    body = re.sub(r"<(code|pre)\b[^>]*>.*?</\1>", "", body, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", " ", body))
    return re.findall(r".{0,30}(?:\*\*|`).{0,30}", text)


def test_a_first_renderer_page_gives_back_its_markdown_in_todays_order(tmp_path):
    page = first_renderer(MD_BEFORE, _with_figures(tmp_path / "src"))
    assert raw_markdown(page)  # the defect: the first renderer printed it
    md, images = first_page_markdown(page)
    assert images == FIGURES
    assert [line for line in md.splitlines() if line] == \
        [line for line in MD_NOW.splitlines() if line]


def test_rerender_writes_what_todays_renderer_writes_for_the_same_report(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.html").write_text(first_renderer(MD_BEFORE, _with_figures(tmp_path / "src")))
    assert rerender(run) is True
    page = (run / "report.html").read_text()
    assert page == markdown_to_html(MD_NOW, tmp_path / "src")
    assert not raw_markdown(page)
    assert "<strong>not reproduced</strong>" in page and "<code>sim/clusters/default.yaml</code>" in page
    assert "<em>for that row's metric</em>" in page and "&lt;b&gt;not a tag&lt;/b&gt;" in page
    assert "<td><strong>bold</strong> and <code>code</code>, 1 &lt; 2</td>" in page
    # the figures right after the verdicts, each figure's bytes as they were
    assert page.index("Where the paper") < page.index("<h2>Figures</h2>") < page.index("The lead point")
    for data in FIGURES.values():
        assert base64.b64encode(data).decode() in page
    # again: the page is today's renderer's, left as it is
    assert rerender(run) is False
    assert (run / "report.html").read_text() == page


def test_rerender_renders_report_md_where_a_run_left_one(tmp_path):
    run = _with_figures(tmp_path / "run")
    (run / "report.md").write_text(MD_NOW)
    (run / "report.html").write_text("stale")
    assert main([str(run)]) == 0
    assert (run / "report.html").read_text() == markdown_to_html(MD_NOW, run)


def test_rerender_refuses_what_it_cannot_read(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "report.html").write_text("<!doctype html><html><body><p>x</p></body></html>")
    assert main([str(tmp_path / "a")]) == 1
    assert "not a page of the first report renderer" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.html").write_text(first_renderer("# r\n\n## Figures\n", tmp_path))
    with pytest.raises(ValueError, match="no .*section"):
        rerender(tmp_path / "b")
    with pytest.raises(FileNotFoundError):
        rerender(tmp_path / "c")


def test_the_command_line_runs_as_a_module(tmp_path):
    run = _with_figures(tmp_path / "run")
    (run / "report.md").write_text(MD_NOW)
    done = subprocess.run([sys.executable, "-m", "analysis.rerender", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {run / 'report.html'}"


@pytest.mark.parametrize("directory", SHIPPED, ids=lambda d: d.name)
def test_the_shipped_reports_are_rendered(directory):
    page = (directory / "report.html").read_text()
    assert not raw_markdown(page), raw_markdown(page)[:5]
    assert "<strong>" in page and "<code>" in page and "<table>" in page
    assert page.index("Where the paper") < page.index("<h2>Figures</h2>") < page.index(
        "The paper's values") < page.index("Trace parameters and sources")
    assert page.count('src="data:image/png;base64,') == 17
    assert FIGURE_NOTES["fig6_act"].split(";")[0] in html.unescape(page)
