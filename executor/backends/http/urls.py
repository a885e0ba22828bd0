"""The ``--allow-url`` list: which destinations a quota key's ``request`` actions may reach.

Entries and requested URLs are compared as *parsed, normalised* URLs - never as
strings - with the same parser (httpx's) that sends the request, so what is checked
is what is sent:

* scheme and host equal (host lower-cased, IDNA-encoded by the parser);
* port equal - the scheme's default when the entry names none; an entry whose port is
  empty or ``*`` (``http://127.0.0.1:``, ``http://127.0.0.1:*/v1``) allows any port;
* the entry's path segments a prefix of the URL's, segment by segment (``/v1`` allows
  ``/v1/x``, not ``/v1x``), after dot-segment removal (``/v1/../admin`` is ``/admin``);
* refused outright: user info (``http://api.test@127.0.0.1/``: the host is what follows
  the ``@``), a backslash, and a percent-encoded ``.``/``..`` segment or ``/`` (a server
  may decode them after the check), and a client-chosen ``Host`` header.

Redirects are not followed (httpx's default, kept by executor/backends/http/backend.py), so no
later hop escapes the check.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote

import httpx

#: headers a client may not set on an outbound call (the destination is the URL's host)
FORBIDDEN_HEADERS = frozenset({"host", "forwarded", "x-forwarded-host", ":authority"})


class UrlRefused(ValueError):
    """A destination refused; the message names the field and says why."""


def _segments(raw_path: bytes, what: str) -> tuple[str, ...]:
    path = raw_path.split(b"?", 1)[0].decode("ascii", "replace")
    out = []
    for seg in path.split("/"):
        plain = unquote(seg)
        if plain != seg and (plain in (".", "..") or "/" in plain or "\\" in plain):
            raise UrlRefused(f"{what}: an encoded '.', '..' or '/' in the path is not allowed")
        if seg:
            out.append(seg)
    return tuple(out)


def parse_target(url: str, what: str = "request.url") -> httpx.URL:
    """``url`` as it will be sent, or UrlRefused."""
    if "\\" in url:
        raise UrlRefused(f"{what}: a backslash is not allowed")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        raise UrlRefused(f"{what}: not a URL ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise UrlRefused(f"{what}: {url[:200]!r} is not an http(s) URL with a host")
    if parsed.userinfo:
        raise UrlRefused(f"{what}: user info ('user@') in a URL is not allowed")
    _segments(parsed.raw_path, what)
    return parsed


@dataclass(frozen=True, slots=True)
class Allowed:
    """One ``--allow-url`` entry, parsed."""

    scheme: str
    host: str
    port: int | None  # None: any port
    segments: tuple[str, ...]

    @classmethod
    def parse(cls, entry: str) -> Allowed:
        what = f"--allow-url {entry!r}"
        scheme, sep, rest = entry.partition("://")
        authority = rest.split("/", 1)[0]
        any_port = sep and (authority.endswith(":") or authority.endswith(":*"))
        if any_port:
            cut = len(authority) - (1 if authority.endswith(":") else 2)
            entry = f"{scheme}://{authority[:cut]}{rest[len(authority):]}"
        url = parse_target(entry, what)
        port = None if any_port else _port(url)
        return cls(url.scheme, url.host, port, _segments(url.raw_path, what))

    def allows(self, url: httpx.URL, port: int, segs: tuple[str, ...]) -> bool:
        """Whether it allows ``url``, whose port and path segments are given (worked out
        once per request by :func:`listed`, not once per entry)."""
        return (url.scheme == self.scheme and url.host == self.host
                and (self.port is None or port == self.port)
                and segs[:len(self.segments)] == self.segments)


def parse_allow_list(allow: Mapping[str, Iterable[str]]) -> dict[str, tuple[Allowed | str, ...]]:
    """Every entry parsed (``*`` kept as is): a malformed one is a start-up error."""
    return {key: tuple(e if e == "*" else Allowed.parse(e) for e in entries)
            for key, entries in allow.items()}


def check_headers(headers: Mapping[str, str] | None) -> None:
    for name in headers or {}:
        if name.strip().lower() in FORBIDDEN_HEADERS:
            raise UrlRefused(f"request.headers: {name!r} is set from the URL, not by the client")


def listed(url: httpx.URL, entries: Iterable[Allowed | str]) -> bool:
    port, segs = _port(url), _segments(url.raw_path, "request.url")
    return any(isinstance(e, Allowed) and e.allows(url, port, segs) for e in entries)


def _port(url: httpx.URL) -> int:
    """The URL's port, the scheme's default when it names none."""
    return url.port or (443 if url.scheme == "https" else 80)
