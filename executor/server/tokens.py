"""The server's bearer tokens and whom each names (ownership).

A trajectory belongs to the token that opened it: another token's request for it (or
for its actions) is answered as for an id that does not exist. A token is known to the
server by a *name*, the owner recorded in the journal - never the token itself, so the
journal holds no secret and a token can be replaced under the same name (its
trajectories stay its name's across a restart).

Where the tokens come from (``tangram serve``):

* ``TANGRAM_TOKEN`` (or, with no tokens at all, one generated and printed): the name
  ``default``, as a one-token server always had;
* ``--tokens-file PATH``: one token per line, ``TOKEN [NAME]``; blank lines and ``#``
  comments are skipped. A line without a name is named ``sha256:<12 hex>`` of its token
  (stable, and saying nothing usable of it). The file must not be readable by other users:
  on a root server the sandboxes run as other users.

A journal from before ownership holds trajectories without an owner: they are
``default``'s (that server's one token).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: the name of TANGRAM_TOKEN's (or the generated) token, and owner of unowned trajectories
DEFAULT = "default"
#: a token's characters: visible ASCII, no spaces (it travels in an HTTP header)
_TOKEN = re.compile(r"[\x21-\x7e]{16,512}")
_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")


class TokensError(Exception):
    """A tokens file that cannot be used; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Tokens:
    """Token -> its name. Looked up in constant time per token (no early exit: the time
    of a refusal says nothing of how close a guess was)."""

    names: Mapping[bytes, str]

    @classmethod
    def single(cls, token: str) -> Tokens:
        """A one-token server (TANGRAM_TOKEN): its token is ``default``."""
        return cls({token.encode(): DEFAULT})

    def who(self, given: bytes) -> str | None:
        """The name of the token ``given``, or None."""
        found = None
        for token, name in self.names.items():
            if hmac.compare_digest(given, token):
                found = name
        return found

    def __len__(self) -> int:
        return len(self.names)


def anonymous_name(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def read_tokens_file(path: Path) -> list[tuple[str, str]]:
    """(token, name) of each line of ``path``; TokensError says what is wrong and where."""
    try:
        st = path.stat()
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokensError(f"--tokens-file {path}: cannot be read ({e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise TokensError(f"--tokens-file {path}: not a regular file")
    if st.st_mode & 0o027:
        raise TokensError(f"--tokens-file {path}: readable or writable by other users (mode "
                          f"{stat.S_IMODE(st.st_mode):o}); its tokens are secrets: "
                          f"`chmod 600 {path}`")
    found: list[tuple[str, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise TokensError(f"--tokens-file {path}:{n}: expected `TOKEN [NAME]`, got "
                              f"{len(words)} words")
        token = words[0]
        if not _TOKEN.fullmatch(token):
            raise TokensError(f"--tokens-file {path}:{n}: a token is 16 to 512 visible ASCII "
                              "characters without spaces")
        name = words[1] if len(words) == 2 else anonymous_name(token)
        if not _NAME.fullmatch(name):
            raise TokensError(f"--tokens-file {path}:{n}: a name is 1 to 64 of "
                              "A-Z a-z 0-9 _ . : @ -")
        found.append((token, name))
    if not found:
        raise TokensError(f"--tokens-file {path}: no token in it")
    return found


def tokens_of(env_token: str | None, file_tokens: list[tuple[str, str]]) -> Tokens:
    """The server's tokens: ``env_token`` (TANGRAM_TOKEN, named ``default``) and the file's;
    TokensError for a token or a name given twice."""
    pairs = ([(env_token, DEFAULT)] if env_token else []) + file_tokens
    names: dict[bytes, str] = {}
    seen: set[str] = set()
    for token, name in pairs:
        if token.encode() in names:
            raise TokensError(f"token named {name!r}: the same token is given twice (as "
                              f"{names[token.encode()]!r} too)")
        if name in seen:
            raise TokensError(f"the name {name!r} is given to two tokens"
                              + (" (`default` is TANGRAM_TOKEN's)" if name == DEFAULT else ""))
        names[token.encode()] = name
        seen.add(name)
    return Tokens(names)
