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

What it keeps is bounded: an output's last ``KEPT_OUTPUT`` bytes (64 KiB; a
client reading the result while the server holds it, ``--result-ttl-s``, gets the whole 1 MiB
tail the backend kept), and the rows of the newest ``KEPT_RESULTS`` actions (50,000: at most
~3.2 GB of outputs in the worst case, a few MB for ordinary ones); older finished ones are
deleted every ``PRUNE_EVERY`` results. An action still queued or running is never pruned.

Ownership (executor/server/tokens.py): each action row names the owner (the
name of the token that submitted it) and the ``owners`` table the owner of each open
trajectory, so a restart keeps every trajectory and result its owner's alone. Both were
added to journals that had none: a row without an owner is ``default``'s (such a journal
comes from a one-token server).

A journal that cannot be used stops the server at start with one message (:class:`JournalError`:
the file, what is wrong, and the choices), never a traceback: one that is not a regular file, is
not owned by the server's user (a journal a sandbox could have written would reopen and replay
whatever it says), or that SQLite cannot read whole (truncated, garbage). Nothing is repaired or
replaced silently: its actions and open trajectories are the operator's to keep or drop.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import stat
import time
from pathlib import Path

from executor.server.schemas import ActionOut
from executor.server.tokens import DEFAULT

RESTARTED = ("the server restarted before this action finished; submit it again under a "
             "new id")
SHUTDOWN = "the server shut down before this action finished; submit it again under a new id"


#: SQLite's files of one journal: the database and, in WAL mode, its log and shared index
SIDE_FILES = ("", "-wal", "-shm")


class JournalError(Exception):
    """The journal cannot be used; the message names the file and what to do."""


def _choices(path: Path) -> str:
    return (f"Either move it aside (`mv {path} {path}.bad`, and its -wal/-shm files if any) "
            "and start again, or start with `tangram serve --reset-state`, which moves it "
            "aside for you; either way the server starts with an empty journal (the actions "
            "and open trajectories it holds are not restored).")


def _file_problem(path: Path) -> str | None:
    """Why a journal file (or its -wal/-shm) must not be opened, before SQLite touches it:
    SQLite follows a symlink, blocks on a FIFO, and takes a journal whoever wrote it."""
    for suffix in SIDE_FILES:
        p = Path(f"{path}{suffix}")
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"{p} cannot be read ({e.strerror})"
        if stat.S_ISDIR(st.st_mode):
            return f"{p} is a directory, not a journal"
        if not stat.S_ISREG(st.st_mode):
            return f"{p} is not a regular file (a symlink, device or pipe)"
        if st.st_uid != os.geteuid():
            return (f"{p} is owned by uid {st.st_uid}, not by this server's user (uid "
                    f"{os.geteuid()}): someone else may have written it, so it is refused "
                    f"(if you trust it, `chown {os.geteuid()} {p}`)")
    return None


def reset(path: Path) -> list[Path]:
    """``--reset-state``: move the journal's files aside (renamed with the time, never
    deleted), so that the server starts with an empty journal; the new names."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    moved = []
    for suffix in SIDE_FILES:
        p = Path(f"{path}{suffix}")
        if p.is_symlink() or p.exists():
            dest = Path(f"{path}.reset-{stamp}{suffix}")
            p.rename(dest)
            moved.append(dest)
    return moved


#: the bytes of an output the journal keeps (its end, after a marker)
KEPT_OUTPUT = 64 << 10
#: finished actions the journal keeps (the newest), pruned every PRUNE_EVERY results
KEPT_RESULTS = 50_000
PRUNE_EVERY = 1_000


def kept(output: str) -> bytes:
    """What the journal keeps of an output: all of it up to KEPT_OUTPUT bytes, else a line
    saying how much was dropped and the last KEPT_OUTPUT bytes."""
    data = output.encode("utf-8", "surrogateescape")
    if len(data) <= KEPT_OUTPUT:
        return data
    return (f"[tangram: the first {len(data) - KEPT_OUTPUT} bytes of this output are not in "
            f"the journal; it keeps the last {KEPT_OUTPUT}]\n").encode() + data[-KEPT_OUTPUT:]


class Journal:
    def __init__(self, path: Path) -> None:
        """Open (or create) the journal at ``path``; :class:`JournalError` if it cannot be used."""
        path.parent.mkdir(parents=True, exist_ok=True)
        problem = _file_problem(path)
        if problem:
            raise JournalError(f"the journal cannot be used: {problem}. {_choices(path)}")
        #: results not written yet, in the order they came
        self._finished: list[tuple[str, str, bytes, str]] = []
        self._since_prune = 0
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            self._prepare()
        except sqlite3.Error as e:
            self.db.close()
            raise JournalError(f"the journal {path} cannot be read ({e}: truncated, or not "
                               f"a journal). {_choices(path)}") from None

    def _prepare(self) -> None:
        # a database SQLite can open may still be cut short: every page is checked once at
        # start (about a second per GB), not found out by a request that reads the bad page
        bad = [r[0] for r in self.db.execute("PRAGMA quick_check")]
        if bad != ["ok"]:
            raise sqlite3.DatabaseError("; ".join(bad[:3]))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(actions)")}
        if cols and "output" not in cols:  # a journal from before outputs were bytes
            self.db.execute("ALTER TABLE actions ADD COLUMN output BLOB")
        if cols and "owner" not in cols:  # a journal from before ownership: NULL, `default`
            self.db.execute("ALTER TABLE actions ADD COLUMN owner TEXT")
        self.db.execute("CREATE TABLE IF NOT EXISTS actions (id TEXT PRIMARY KEY, trajectory "
                        "TEXT, body TEXT, status TEXT, result TEXT, output BLOB, owner TEXT)")
        self.db.execute("CREATE TABLE IF NOT EXISTS owners (trajectory TEXT PRIMARY KEY, "
                        "owner TEXT)")
        self.db.execute("CREATE TABLE IF NOT EXISTS trajectories (id TEXT PRIMARY KEY, task "
                        "TEXT, mem_gb REAL, image TEXT)")

    def recover(self) -> int:
        """Mark what a previous process left unfinished as failed; how many."""
        return self.fail_unfinished(RESTARTED)

    def fail_unfinished(self, why: str) -> int:
        self.flush()
        result = json.dumps({"error": why})
        cur = self.db.execute("UPDATE actions SET status='failed', result=? "
                              "WHERE status IN ('queued', 'running')", (result,))
        return cur.rowcount

    def submitted(self, aid: str, trajectory: str, body: str, owner: str = DEFAULT) -> None:
        if any(row[3] == aid for row in self._finished):  # (a batch is a turn's results)
            self.flush()  # an earlier result of this id must not overwrite the new row
        self.db.execute("INSERT OR REPLACE INTO actions (id, trajectory, body, status, result, "
                        "output, owner) VALUES (?, ?, ?, 'queued', NULL, NULL, ?)",
                        (aid, trajectory, body, owner))

    def finished(self, out: ActionOut) -> None:
        meta = out.model_dump_json(exclude={"output"})
        self._finished.append((out.status, meta, kept(out.output), out.id))
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
        self._since_prune += len(rows)
        self.db.execute("BEGIN")
        try:
            self.db.executemany("UPDATE actions SET status=?, result=?, output=? WHERE id=?",
                                rows)
            if self._since_prune >= PRUNE_EVERY:
                self._since_prune = 0
                self.db.execute("DELETE FROM actions WHERE status NOT IN ('queued', 'running') "
                                "AND rowid <= (SELECT MAX(rowid) FROM actions) - ?",
                                (KEPT_RESULTS,))
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def opened(self, tid: str, task: str, mem_gb: float | None, image: str | None) -> None:
        self.db.execute("INSERT OR REPLACE INTO trajectories VALUES (?, ?, ?, ?)",
                        (tid, task, mem_gb, image))

    def opened_all(self, rows: list[tuple[str, str, float | None, str | None]],
                   owner: str | None = None) -> None:
        """Several trajectories opened at once (a fork's copies), ``owner``'s when given,
        in one transaction: a crash journals all of them or none."""
        self.db.execute("BEGIN")
        try:
            self.db.executemany("INSERT OR REPLACE INTO trajectories VALUES (?, ?, ?, ?)",
                                rows)
            if owner is not None:
                self.db.executemany("INSERT OR REPLACE INTO owners VALUES (?, ?)",
                                    [(row[0], owner) for row in rows])
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def closed(self, tid: str) -> None:
        self.db.execute("DELETE FROM trajectories WHERE id=?", (tid,))
        self.db.execute("DELETE FROM owners WHERE trajectory=?", (tid,))

    def owned(self, tid: str, owner: str) -> None:
        """``tid`` (opened, or being filled by a fork) is ``owner``'s."""
        self.db.execute("INSERT OR REPLACE INTO owners VALUES (?, ?)", (tid, owner))

    def owner(self, tid: str) -> str:
        """The owner of open trajectory ``tid`` (``default`` when the journal names none)."""
        row = self.db.execute("SELECT owner FROM owners WHERE trajectory=?", (tid,)).fetchone()
        return row[0] if row and row[0] else DEFAULT

    def action_owner(self, aid: str) -> str | None:
        """The owner of action ``aid`` (None: no such action)."""
        self.flush()
        row = self.db.execute("SELECT owner FROM actions WHERE id=?", (aid,)).fetchone()
        return None if row is None else row[0] or DEFAULT

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
