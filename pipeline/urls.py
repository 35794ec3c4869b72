"""Shard URLs: brace expansion, scheme checks and credential redaction.

Anything fsspec opens is a valid shard location. `pipe:` URLs run a shell command, so they are
refused unless the caller explicitly allows them. Credentials inside URLs (user:password@,
signed query parameters) are redacted before a URL reaches a log, an error or a file we write.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")
_SECRET_PARAMS = re.compile(r"(sig|signature|token|key|secret|password|credential|auth)", re.I)
MAX_EXPANSION = 1_000_000
# Tries of remote reads after a transient failure (the streaming fetcher, start-up checks):
RETRIES = 3  # further tries
BACKOFF_S = 0.5  # before the first retry; doubled for each next one
# A 429 or 503 that says how long to wait (Retry-After) is waited that long instead, up to
# this: a server asking for more gets its next try then (listing.retry_wait)
RETRY_AFTER_MAX_S = 60.0


def expand_braces(pattern: str) -> list[str]:
    """`a-{000..002}.tar` -> three names; `{x,y}` alternatives; zero padding kept."""
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    out: list[str] = []
    for choice in _brace_choices(match.group(1), pattern):
        out.extend(expand_braces(head + choice + tail))
        if len(out) > MAX_EXPANSION:
            raise ValueError(f"{redact(pattern)!r} expands to more than {MAX_EXPANSION} names")
    return out


def _brace_choices(body: str, pattern: str) -> list[str]:
    rng = _RANGE.match(body)
    if rng is None:
        if "," not in body:
            raise ValueError(f"brace group {{{body}}} in {redact(pattern)!r} is neither a "
                             "range like {000..127} nor a list like {a,b}")
        return body.split(",")
    lo, hi = rng.group(1), rng.group(2)
    if int(hi) < int(lo):
        raise ValueError(f"brace range {{{body}}} in {redact(pattern)!r} runs backwards")
    width = len(lo) if lo.startswith("0") else 0
    return [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]


def check_scheme(url: str, *, allow_pipe: bool = False) -> str:
    """Refuse `pipe:` URLs (they execute a command) unless explicitly allowed."""
    if url.startswith("pipe:") and not allow_pipe:
        raise ValueError(f"refusing {redact(url)!r}: pipe: URLs run a shell command; a "
                         "loader accepts them only with allow_pipe=True, for sources you trust")
    return url


_URL_IN_TEXT = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def scrub(text: str) -> str:
    """`text` (an exception's message, say) with every URL in it redacted."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


def beside(url: str, suffix: str, replace: str = ".tar") -> str:
    """The URL of the file next to `url` whose name ends in `suffix` instead of `replace`
    (a shard's .idx), keeping a query string (a signed URL's) where it is."""
    parts = urlsplit(url) if "://" in url else None
    path = parts.path if parts else url
    path = path[: -len(replace)] + suffix if path.endswith(replace) else path + suffix
    return urlunsplit(parts._replace(path=path)) if parts else path


def is_remote(url: str) -> bool:
    scheme = urlsplit(url).scheme
    return len(scheme) > 1 and scheme != "file"  # one letter: a Windows drive


_USERINFO = re.compile(r"(?<=://)[^/\s@]+@")


def redact(url: str) -> str:
    """The URL with user:password and secret-looking query values replaced by ***."""
    if url.startswith("pipe:"):  # a command line: redact every URL inside it
        return _USERINFO.sub("***@", url)
    if "://" not in url and "?" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = urlencode([(k, "***" if _SECRET_PARAMS.search(k) else v)
                       for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class _ScrubSecrets(logging.Filter):
    """Rewrites a record's message with every URL in it redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the library's to report
            return True
        if "://" in message:
            record.msg, record.args = scrub(message), None
        return True


# The file-system libraries log full URLs (signed query strings included) at DEBUG. A logger's
# filters do not apply to its children's records, so each logger that logs URLs gets one.
LIBRARY_LOGGERS = ("fsspec", "fsspec.http", "fsspec.asyn", "fsspec.spec", "fsspec.caching",
                   "fsspec.implementations.http", "s3fs", "gcsfs", "adlfs", "aiohttp.client")


def guard_library_logs() -> None:
    """Make the libraries we read URLs through redact them in their own log records (idempotent)."""
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ScrubSecrets) for f in logger.filters):
            logger.addFilter(_ScrubSecrets())


guard_library_logs()  # at import: every module that handles URLs imports this one
