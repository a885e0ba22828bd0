"""The reproduction on record (docs/evidence/): its files' schema, and that the paper-scale
run has every headline the quick run has. Reads the committed files only (no simulation)."""

import json
from pathlib import Path

from test_reproduce import ROW_KEYS

EVIDENCE = Path(__file__).parent.parent / "docs" / "evidence"
RUN_KEYS = {"command", "scale", "commit", "machine", "load_average_start", "load_average_end",
            "wall_s", "cpu_s", "simulations", "finished"}


def _record(name: str) -> tuple[list[dict], dict, dict]:
    d = EVIDENCE / name
    results = json.loads((d / "results.json").read_text())
    evidence = json.loads((d / "evidence.json").read_text())
    run = json.loads((d / "run.json").read_text())
    assert (d / "report.html").read_text().startswith("<!doctype html>")
    for r in results:
        assert set(r) == ROW_KEYS, r["name"]
    assert RUN_KEYS <= set(run) and run["scale"] == name
    assert run["commit"] and run["machine"]["cpus"] and run["wall_s"] > 0
    # every ratio headline: the mean over >= 5 seeds, its interval, the best for its metric
    for r in results:
        if r["evidence"] is not None and r["unit"] == "x":
            ev = r["evidence"]
            assert len(ev["seeds"]) >= 5 and r["ci"] and r["ci_vs_best"], r["name"]
            assert r["best_baseline"] == ev["best"]["label"], r["name"]
    return results, evidence, run


def test_quick_record_schema():
    results, evidence, run = _record("quick")
    assert "coding_act" in evidence and evidence["coding_act"].get("joint")
    assert run["cpu_s"] > 0


def test_full_record_has_every_quick_headline():
    """The paper-scale run is on record, or the README says how far it got and why not."""
    full = EVIDENCE / "full" / "results.json"
    if not full.exists():
        text = (EVIDENCE / "README.md").read_text()
        assert "did not finish" in text and "resume" in text
        return
    quick, _, _ = _record("quick")
    results, _, run = _record("full")
    keys = {r["key"] for r in results if r["key"]}
    assert {r["key"] for r in quick if r["key"]} <= keys
    assert "--full" in run["command"]
