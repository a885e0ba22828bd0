"""The server's journal: submitted actions and their results, in SQLite.

Outputs are stored as raw bytes in their own column (a result's JSON without
its output sits beside it), so a command printing NUL bytes costs its size,
not six times that as JSON escapes. One writer: the event loop's thread.

A submission is written at once (its acknowledgement promises it is kept). Results are
batched: the actions that finish during one turn of the event loop are written in one
transaction on the next turn (a commit per result cost more than the rest of the
write), before a waiting client is woken to read them (that takes the loop two more
turns). Every read writes the batch first. A crash loses at most that turn's results:
those actions then read as unfinished, reported failed after the restart, as a crash
a moment earlier would have left them.

Open trajectories are journalled too (written at once, as their open's answer promises
them), and forgotten at their close: a server restarted on the same state directory
opens again those a crash (or a stop) left open (executor/server/service.py), so their
clients' next submits find them.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

from executor.server.schemas import ActionOut

RESTARTED = ("the server restarted before this action finished; submit it again under a "
             "new id")
SHUTDOWN = "the server shut down before this action finished; submit it again under a new id"


class Journal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(actions)")}
        if cols and "output" not in cols:  # a journal from before outputs were bytes
            self.db.execute("ALTER TABLE actions ADD COLUMN output BLOB")
        self.db.execute("CREATE TABLE IF NOT EXISTS actions (id TEXT PRIMARY KEY, trajectory "
                        "TEXT, body TEXT, status TEXT, result TEXT, output BLOB)")
        self.db.execute("CREATE TABLE IF NOT EXISTS trajectories (id TEXT PRIMARY KEY, task "
                        "TEXT, mem_gb REAL, image TEXT)")
        #: results not written yet, in the order they came
        self._finished: list[tuple[str, str, bytes, str]] = []

    def recover(self) -> int:
        """Mark what a previous process left unfinished as failed; how many."""
        return self.fail_unfinished(RESTARTED)

    def fail_unfinished(self, why: str) -> int:
        self.flush()
        result = json.dumps({"error": why})
        cur = self.db.execute("UPDATE actions SET status='failed', result=? "
                              "WHERE status IN ('queued', 'running')", (result,))
        return cur.rowcount

    def submitted(self, aid: str, trajectory: str, body: str) -> None:
        if any(row[3] == aid for row in self._finished):  # (a batch is a turn's results)
            self.flush()  # an earlier result of this id must not overwrite the new row
        self.db.execute("INSERT OR REPLACE INTO actions VALUES (?, ?, ?, 'queued', NULL, NULL)",
                        (aid, trajectory, body))

    def finished(self, out: ActionOut) -> None:
        meta = out.model_dump_json(exclude={"output"})
        self._finished.append((out.status, meta, out.output.encode("utf-8", "surrogateescape"),
                               out.id))
        if len(self._finished) > 1:
            return  # the batch's write is already due
        try:
            asyncio.get_running_loop().call_soon(self.flush)
        except RuntimeError:  # no event loop (tools, tests): at once
            self.flush()

    def flush(self) -> None:
        """Write the results not written yet, in one transaction."""
        if not self._finished:
            return
        rows, self._finished = self._finished, []
        self.db.execute("BEGIN")
        try:
            self.db.executemany("UPDATE actions SET status=?, result=?, output=? WHERE id=?",
                                rows)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def opened(self, tid: str, task: str, mem_gb: float | None, image: str | None) -> None:
        self.db.execute("INSERT OR REPLACE INTO trajectories VALUES (?, ?, ?, ?)",
                        (tid, task, mem_gb, image))

    def opened_all(self, rows: list[tuple[str, str, float | None, str | None]]) -> None:
        """Several trajectories opened at once (a fork's copies), in one transaction:
        a crash journals all of them or none."""
        self.db.execute("BEGIN")
        try:
            self.db.executemany("INSERT OR REPLACE INTO trajectories VALUES (?, ?, ?, ?)",
                                rows)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def closed(self, tid: str) -> None:
        self.db.execute("DELETE FROM trajectories WHERE id=?", (tid,))

    def open_trajectories(self) -> list[tuple[str, str, float | None, str | None]]:
        """(id, task, mem_gb, image) of every trajectory opened and not closed, in the
        order they were opened."""
        return list(self.db.execute("SELECT id, task, mem_gb, image FROM trajectories "
                                    "ORDER BY rowid"))

    def body(self, aid: str) -> tuple[str, str] | None:
        """(trajectory, request body) of a submitted action."""
        self.flush()
        row = self.db.execute("SELECT trajectory, body FROM actions WHERE id=?", (aid,)).fetchone()
        return (row[0], row[1]) if row else None

    def get(self, aid: str) -> ActionOut | None:
        self.flush()
        row = self.db.execute("SELECT trajectory, status, result, output FROM actions WHERE id=?",
                              (aid,)).fetchone()
        if row is None:
            return None
        trajectory, st, result, output = row
        data = json.loads(result) if result else {}
        if "id" in data:
            text = output.decode("utf-8", "replace") if output else data.get("output", "")
            return ActionOut(**{**data, "output": text})
        return ActionOut(id=aid, trajectory=trajectory, status=st, error=data.get("error", ""))

    def close(self) -> None:
        self.flush()
        self.db.close()
