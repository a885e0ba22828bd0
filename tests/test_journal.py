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
