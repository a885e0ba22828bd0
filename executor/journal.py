"""The server's journal: submitted actions and their results, in SQLite.

Outputs are stored as raw bytes in their own column (a result's JSON without
its output sits beside it), so a command printing NUL bytes costs its size,
not six times that as JSON escapes. One writer: the event loop's thread.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from executor.schemas import ActionOut

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

    def recover(self) -> int:
        """Mark what a previous process left unfinished as failed; how many."""
        return self.fail_unfinished(RESTARTED)

    def fail_unfinished(self, why: str) -> int:
        result = json.dumps({"error": why})
        cur = self.db.execute("UPDATE actions SET status='failed', result=? "
                              "WHERE status IN ('queued', 'running')", (result,))
        return cur.rowcount

    def submitted(self, aid: str, trajectory: str, body: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO actions VALUES (?, ?, ?, 'queued', NULL, NULL)",
                        (aid, trajectory, body))

    def finished(self, out: ActionOut) -> None:
        meta = out.model_dump_json(exclude={"output"})
        self.db.execute("UPDATE actions SET status=?, result=?, output=? WHERE id=?",
                        (out.status, meta, out.output.encode("utf-8", "surrogateescape"), out.id))

    def body(self, aid: str) -> tuple[str, str] | None:
        """(trajectory, request body) of a submitted action."""
        row = self.db.execute("SELECT trajectory, body FROM actions WHERE id=?", (aid,)).fetchone()
        return (row[0], row[1]) if row else None

    def get(self, aid: str) -> ActionOut | None:
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
        self.db.close()
