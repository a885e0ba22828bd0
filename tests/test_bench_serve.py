"""`tangram bench serve-scale`'s measuring loop on a real `tangram serve` (tiny scale:
the figures themselves are not asserted, only that they are all there and consistent)."""

from analysis.bench.serve import serve_bench


def test_serve_bench_samples_over_time():
    seen: list[dict] = []
    res = serve_bench("process", trajectories=3, actions=4, every_s=0.2, on_sample=seen.append)
    assert res["actions"] == 12 and res["errors"] == 0, res["first_errors"]
    assert res["timeline"] == seen and seen, "every sample is reported as it is taken"
    for row in seen:
        assert set(row) >= {"t_s", "actions_done", "actions_per_s", "server_cpu_ms_per_action",
                            "server_rss_mb", "load_avg_1m"}
        assert 0 <= row["actions_done"] <= 12 and row["server_rss_mb"] > 0
    assert [r["t_s"] for r in seen] == sorted(r["t_s"] for r in seen)
    assert seen[-1]["actions_done"] == 12, "the last sample is the end of the run"
    growth = res["server_rss_mb"][-1] - seen[0]["server_rss_mb"]
    assert abs(res["server_rss_growth_mb"] - growth) < 0.2
    assert res["client_cpu_ms_per_action"] > 0


def test_serve_bench_over_several_client_processes():
    res = serve_bench("process", trajectories=4, actions=3, every_s=0.2, clients=2)
    assert res["actions"] == 12 and res["errors"] == 0, res["first_errors"]
    assert res["clients"] == 2 and res["timeline"][-1]["actions_done"] == 12
    assert res["client_cpu_ms_per_action"] > 0
