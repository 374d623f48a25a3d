"""Secrets kept out of logs: masking filters, secret fragments of URLs, secret files.

Alert URLs (``observe.alerts``) and reward-endpoint tokens (``rollout.rewards``) are read
from 0600 files or environment variables and never written to ``config.yaml``; every
record a process logs passes a filter that replaces each secret fragment with ``***``.

Must not: import anything of ours beyond the standard library.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

log = logging.getLogger(__name__)

MASK = "***"
MIN_SECRET_CHARS = 4  # shorter fragments ("to", "1") would mask ordinary words


def secret_fragments(urls: Iterable[str]) -> list[str]:
    """Substrings to mask: each URL, its user/password, path parts and query values."""
    fragments = set()
    for url in urls:
        fragments.add(url)
        parts = urlsplit(url)
        fragments.update(filter(None, (parts.username, parts.password)))
        fragments.update(p for p in parts.path.split("/") if p)
        fragments.update(value for _, value in parse_qsl(parts.query) if value)
    kept = (f for f in fragments if len(f) >= MIN_SECRET_CHARS)
    return sorted(kept, key=len, reverse=True)  # whole URLs before their parts


def redact(text: str, fragments: Iterable[str]) -> str:
    for fragment in fragments:
        text = text.replace(fragment, MASK)
    return text


class RedactingFilter(logging.Filter):
    def __init__(self, fragments: list[str]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message, self.fragments)
        if masked != message:
            record.msg, record.args = masked, ()
        return True


def mask_in_logs(fragments: list[str], logger_names: Iterable[str] = ()) -> None:
    """Mask ``fragments`` in every record of the root logger's handlers (and the named
    loggers'), so records of any logger that reach them are masked."""
    if not fragments:
        return
    secret_filter = RedactingFilter(sorted(set(fragments), key=len, reverse=True))
    for logger in (logging.getLogger(), *map(logging.getLogger, logger_names)):
        logger.addFilter(secret_filter)
        for handler in logger.handlers:
            handler.addFilter(secret_filter)


def read_secret_file(path: Path, what: str) -> str:
    """The text of a file that holds secrets; a warning if others may read it."""
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: %s is readable by others; chmod 600 it (it holds secrets)", what, path)
    return path.read_text(encoding="utf-8")
