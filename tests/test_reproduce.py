"""`tangram reproduce --quick` (a tiny subset) and `tangram plot`, through the CLI."""

import json
import subprocess
import sys
from pathlib import Path

from analysis.experiments import GapInstance, exhaustive, hesrpt, tangram_total

ROOT = Path(__file__).parent.parent


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_reproduce_quick_subset_writes_results_report_and_figures(tmp_path):
    res = cli("reproduce", "--quick", "--only", "fig6", "--only", "optgap", "--out",
              str(tmp_path), "--quiet")
    assert res.returncode == 0, res.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    names = {r["name"] for r in results}
    assert "coding: mean ACT, k8s / Tangram" in names
    for r in results:
        assert set(r) == {"name", "paper", "ours", "unit", "note"}
    act = next(r for r in results if r["name"] == "coding: mean ACT, k8s / Tangram")
    assert act["paper"] == 4.3 and act["ours"] > 1.0  # measured, and Tangram wins here
    html = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64" in html and "Trace parameters and sources" in html
    assert (tmp_path / "figures" / "fig6_act.png").exists()
    assert (tmp_path / "figures" / "fig6_act.svg").exists()
    bad = cli("reproduce", "--quick", "--only", "nope", "--out", str(tmp_path / "x"), "--quiet")
    assert bad.returncode == 2 and "unknown experiment" in bad.stderr


def test_plot_draws_standard_figures(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out, policy in ((a, "tangram"), (b, "k8s")):
        r = cli("simulate", "--trace", str(ROOT / "traces/samples/mopd.parquet"), "--policy",
                policy, "--out", str(out), "--quiet")
        assert r.returncode == 0, r.stderr
    r = cli("plot", str(a), str(b), "--out", str(tmp_path / "fig"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fig" / "act_cdf.png").exists()
    r = cli("plot", str(tmp_path / "missing"))
    assert r.returncode == 2 and "summary.json" in r.stderr


def test_optgap_references_bound_each_other():
    inst = GapInstance(sizes=[30.0, 10.0, 20.0], p=0.8, cores=4, choices=[1, 2, 4])
    ex, he, tg = exhaustive(inst), hesrpt(inst), tangram_total(inst)
    assert he <= ex + 1e-9  # preemptive fractional optimum is a lower bound
    assert ex <= tg + 1e-9  # the exhaustive search covers the greedy's choices
