"""The journal (real SQLite): results finishing in one turn of the event loop are
written in one transaction; reads see them at once; submissions are written at once."""

import asyncio

from executor.server.journal import Journal
from executor.server.schemas import ActionOut


def _commits(journal: Journal) -> list[str]:
    seen: list[str] = []
    journal.db.set_trace_callback(lambda sql: seen.append(sql) if sql == "COMMIT" else None)
    return seen


def test_results_of_one_turn_are_one_transaction(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    for i in range(3):
        journal.submitted(f"a{i}", "t", "{}")
    commits = _commits(journal)

    async def finish_three() -> None:
        for i in range(3):
            journal.finished(ActionOut(id=f"a{i}", trajectory="t", status="ok", output=f"o{i}"))
        assert commits == []  # not yet: at the end of this turn
        await asyncio.sleep(0)
        assert commits == ["COMMIT"]

    asyncio.run(finish_three())
    assert [journal.get(f"a{i}").output for i in range(3)] == ["o0", "o1", "o2"]
    journal.close()
    again = Journal(tmp_path / "j.sqlite")
    assert again.get("a2").status == "ok" and again.recover() == 0


def test_reads_and_resubmissions_see_pending_results(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    journal.submitted("a", "t", "{}")

    async def go() -> None:
        journal.finished(ActionOut(id="a", trajectory="t", status="failed", error="x"))
        assert journal.get("a").status == "failed"  # a read writes the batch first
        journal.finished(ActionOut(id="a", trajectory="t", status="ok"))
        journal.submitted("a", "t", '{"again": 1}')  # after the pending result, not before
        await asyncio.sleep(0)

    asyncio.run(go())
    assert journal.body("a") == ("t", '{"again": 1}')
    assert journal.get("a").status == "queued"
    assert journal.fail_unfinished("gone") == 1


def test_without_a_loop_results_are_written_at_once(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    journal.submitted("a", "t", "{}")
    commits = _commits(journal)
    journal.finished(ActionOut(id="a", trajectory="t", status="ok"))
    assert commits == ["COMMIT"]


def test_what_the_journal_keeps_is_bounded(tmp_path, monkeypatch):
    """Issue 45 #11: an output's last KEPT_OUTPUT bytes after a line saying what was
    dropped; the newest KEPT_RESULTS actions' rows, an unfinished one never pruned."""
    from executor.server import journal as module

    monkeypatch.setattr(module, "KEPT_RESULTS", 5)
    monkeypatch.setattr(module, "PRUNE_EVERY", 2)
    journal = Journal(tmp_path / "j.sqlite")
    journal.submitted("waiting", "t", "{}")
    big = "x" * (module.KEPT_OUTPUT * 3) + "the end"
    for i in range(12):
        journal.submitted(f"a{i}", "t", "{}")
        journal.finished(ActionOut(id=f"a{i}", trajectory="t", status="ok",
                                   output=big if i == 11 else f"o{i}"))
    kept = journal.get("a11").output
    assert kept.endswith("the end") and len(kept.encode()) < module.KEPT_OUTPUT + 200
    assert kept.startswith(f"[tangram: the first {len(big) - module.KEPT_OUTPUT} bytes")
    rows = {r[0] for r in journal.db.execute("SELECT id FROM actions")}
    assert "waiting" in rows and "a0" not in rows and {"a9", "a10", "a11"} <= rows
    assert len(rows) <= 5 + 2 + 1, rows  # (pruned every PRUNE_EVERY results)
    journal.close()
