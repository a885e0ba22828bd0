"""Attack (issue 45, finding 4): huge unit sets in an action's `cpu` and `gpus` against a real
`tangram serve` (process backend, no GPUs).

Before, `gpus` went through a second, unbounded parser that expanded the set and cached it:
`"gpus": "1-2000000"` held the event loop ~1 s and kept ~76 MiB per distinct string, and
`"1-999999999"` had the server killed by the kernel's OOM killer. Every field now goes through
tangram/units.py: a 422 naming the field and value, nothing expanded, nothing cached.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import TOKEN

H = {"Authorization": f"Bearer {TOKEN}"}

BAD = ["1-2000000", "1-999999999", "0-4294967295", "  1-999999999  ", "1 -\t2000000",
       ",".join(str(i) for i in range(2000)), ",".join(str(i) for i in range(1, 66)),
       "0," + ",".join(str(i) for i in range(1, 60)), "8-2", "-3", "-1-4", " ", "",
       "1,2,99999999999", "1-2000000,1"]


def _bodies(field: str, value: str, aid: str) -> dict:
    """An action carrying ``value`` in ``field``: a GPU action (a service) for ``gpus``, a
    command for ``cpu``; ``gpus`` on a command too (checked whatever the action's kind)."""
    if field == "gpus":
        return {"id": aid, "service": "judge", "gpus": value, "inputs": {"tokens": [[1]]}}
    if field == "gpus-on-command":
        return {"id": aid, "argv": ["true"], "gpus": value}
    return {"id": aid, "argv": ["true"], "cpu": value}


FIELDS = ["cpu", "gpus", "gpus-on-command"]


@pytest.fixture(scope="module")
def http(process_server):
    with httpx.Client(base_url=process_server.url, headers=H, timeout=120) as c:
        assert c.post("/v1/trajectories", json={"id": "units", "task": "t"}).status_code == 201
        yield c


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def _field_of(detail: dict) -> str:
    return str(detail["loc"][-1])


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", BAD, ids=range(len(BAD)))
def test_each_field_refuses_each_bad_set_with_a_clear_422(http, field, value):
    name = field.split("-")[0]
    r = http.post("/v1/trajectories/units/actions", json=_bodies(field, value, "u-1"))
    assert r.status_code == 422, (field, value, r.status_code, r.text[:300])
    detail = r.json()["detail"][0]
    assert _field_of(detail) == name, detail
    # the reason names the field and the value as sent (pydantic's own length check gives
    # the value as `input`)
    assert f"{name}: " in detail["msg"] or "at most" in detail["msg"], detail
    assert repr(value)[:20] in detail["msg"] or detail.get("input") == value, detail
    assert http.get("/v1/actions/u-1").status_code == 404  # nothing was recorded


@pytest.mark.parametrize("field", ["cpu", "gpus"])
def test_batch_items_refuse_bad_sets(http, field):
    items = [{"trajectory": "units", "action": _bodies(field, "1", "b-ok")},
             {"trajectory": "units", "action": _bodies(field, "1-999999999", "b-bad")}]
    r = http.post("/v1/actions:batch", json={"actions": items})
    assert r.status_code == 422, r.text[:300]
    assert "1-999999999" in r.text and field in r.text, r.text[:300]
    assert http.get("/v1/actions/b-ok").status_code == 404  # all or nothing


def test_rss_stays_flat_over_distinct_huge_sets(http, process_server):
    """20 requests per field, each a new huge string (a cache keyed by them would keep each
    one): the server's resident memory grows by at most a few MiB (before: +76 MiB per
    `gpus` request, ~1.5 GiB for the 20)."""
    pid = process_server.proc.pid

    def burst(field: str, n: int, start: int) -> None:
        for i in range(start, start + n):
            r = http.post("/v1/trajectories/units/actions",
                          json=_bodies(field, f"1-{2_000_000 + i}", f"rss-{field}-{i}"))
            assert r.status_code == 422, r.text[:300]

    for field in FIELDS:
        burst(field, 3, 0)  # the handler's first-use allocations
        before = _rss_mib(pid)
        burst(field, 20, 100)
        after = _rss_mib(pid)
        assert after - before < 8, (f"{field}: VmRSS {before:.1f} -> {after:.1f} MiB over 20 "
                                    "refused requests")
    assert http.get("/healthz").status_code == 200
