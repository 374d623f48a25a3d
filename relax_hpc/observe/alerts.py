"""Alerts through Apprise: e-mail, webhooks, chat, whatever an Apprise URL names.

Apprise URLs carry credentials (SMTP passwords, webhook tokens), so they are secrets:
- they are read from a 0600 file or an environment variable, never from ``config.yaml``
  (``urls`` given in a config are moved into ``RunPaths.alert_urls_file`` at submission);
- everything this process logs passes a filter that masks every URL and its credential
  parts (``install_redaction``), and Apprise's own logger is kept at WARNING.

Delivery never blocks or breaks the caller: ``Notifier.send`` queues, one daemon thread
delivers, every failure is logged (masked) and swallowed. A rate limiter whose state
lives in the run directory (``RunPaths.alert_state``) spaces events of one kind by
``min_interval_s`` and caps all events at ``max_per_hour``; ``failed`` and ``finished``
always go out.

Must not: be called from the training loop (the run watcher, the submitter and the
batch script's end-of-job command send alerts; training processes never do).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from relax_hpc.config.schema import AlertConfig
from relax_hpc.observe.redaction import (  # noqa: F401 (redact: re-exported for callers)
    mask_in_logs,
    read_secret_file,
    redact,
    secret_fragments,
)
from relax_hpc.paths import RunPaths, atomic_write_json, atomic_write_text, read_json

log = logging.getLogger(__name__)

ALWAYS_SENT = ("failed", "finished")
SEVERITY = {"failed": "failure", "stalled": "warning", "requeued": "warning", "finished": "success"}


@dataclass(frozen=True)
class Alert:
    event: str  # one of config.schema.ALERT_EVENTS
    title: str
    body: str


# --- where the URLs come from ------------------------------------------------------------------
def split_urls(text: str) -> list[str]:
    """URLs separated by whitespace or commas; ``#`` starts a comment up to the line end."""
    lines = (
        line.split("#", 1)[0] if line.lstrip().startswith("#") else line
        for line in text.splitlines()
    )
    return [u for line in lines for u in re.split(r"[\s,]+", line) if u]


def _read_urls_file(path: Path) -> list[str]:
    return split_urls(read_secret_file(path, "alerts"))


def load_alert_urls(
    cfg: AlertConfig, paths: RunPaths | None, environ: Mapping[str, str] = os.environ
) -> list[str]:
    """Every configured URL: the run's secrets file, ``urls_file``, then ``urls_env``."""
    urls = list(cfg.urls)
    files = [paths.alert_urls_file] if paths is not None else []
    if cfg.urls_file:
        files.append(Path(cfg.urls_file).expanduser())
    for path in files:
        if path.is_file():
            urls += _read_urls_file(path)
    urls += split_urls(environ.get(cfg.urls_env, "")) if cfg.urls_env else []
    return list(dict.fromkeys(urls))


def move_urls_to_secrets(cfg: AlertConfig, paths: RunPaths) -> AlertConfig:
    """Config-given URLs go to a 0600 file of the run; the returned config holds none."""
    if not cfg.urls:
        return cfg
    paths.secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write_text(paths.alert_urls_file, "\n".join(cfg.urls) + "\n", mode=0o600)
    return replace(cfg, urls=[])


# --- keeping them out of logs ------------------------------------------------------------------
def describe_url(url: str) -> str:
    """What a log may say about a URL: its service and host, nothing else."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}"


def install_redaction(urls: list[str]) -> None:
    """Mask the URLs in every record of every handler of the root logger (and Apprise's)."""
    logging.getLogger("apprise").setLevel(logging.WARNING)
    mask_in_logs(secret_fragments(urls), ["apprise"])


# --- rate limit --------------------------------------------------------------------------------
class AlertState:
    """Persisted in the run directory: last send per event, recent sends, once-only events."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict:
        state = read_json(self.path, default={})
        state.setdefault("last_sent_s", {})
        state.setdefault("recent_s", [])
        state.setdefault("once", [])
        return state

    def save(self, state: dict) -> None:
        try:
            atomic_write_json(self.path, state)
        except OSError as err:  # a full filesystem: alerts still go out, unthrottled state
            log.warning("alerts: cannot write %s: %s", self.path, err)


class RateLimiter:
    def __init__(self, cfg: AlertConfig, state: AlertState, clock=time.time) -> None:
        self.cfg = cfg
        self.state = state
        self.clock = clock

    def allow(self, event: str) -> bool:
        """Whether ``event`` may go out now; if so, it is recorded as sent."""
        state, now = self.state.load(), self.clock()
        recent = [t for t in state["recent_s"] if now - t < 3600.0]
        last = state["last_sent_s"].get(event)
        allowed = event in ALWAYS_SENT or (
            (last is None or now - last >= self.cfg.min_interval_s)
            and len(recent) < self.cfg.max_per_hour
        )
        if allowed:
            state["last_sent_s"][event] = now
            recent.append(now)
        state["recent_s"] = recent
        self.state.save(state)
        return allowed


# --- delivery ----------------------------------------------------------------------------------
def apprise_delivery(urls: list[str], timeout_s: float) -> Callable[[Alert], bool]:
    """A function that sends one alert to every URL; True when all of them took it."""
    import apprise

    client = apprise.Apprise()
    for url in urls:
        if not client.add(url):
            log.warning("alerts: Apprise does not understand %s; skipped", describe_url(url))

    def deliver(alert: Alert) -> bool:
        if not len(client):
            return False
        severity = SEVERITY.get(alert.event, "info")
        result = client.notify(
            body=alert.body, title=alert.title, notify_type=severity, timeout=timeout_s
        )
        return bool(result)

    return deliver


class Notifier:
    """Queues alerts and delivers them from one background thread; never raises."""

    def __init__(
        self,
        cfg: AlertConfig,
        limiter: RateLimiter,
        deliver: Callable[[Alert], bool] | None,
    ) -> None:
        self.cfg = cfg
        self.limiter = limiter
        self.deliver = deliver
        self.queue: queue.Queue[Alert | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="alerts", daemon=True)
        self.thread.start()

    def send(self, alert: Alert) -> bool:
        """Queue ``alert`` if its event is enabled and the rate limit allows; True if queued."""
        try:
            if self.deliver is None or alert.event not in self.cfg.events:
                return False
            if not self.limiter.allow(alert.event):
                log.info("alerts: %s suppressed by the rate limit", alert.event)
                return False
            self.queue.put(alert)
            return True
        except Exception as err:  # an alert must never break what sends it
            log.warning("alerts: could not queue %s: %s", alert.event, err)
            return False

    def close(self, timeout_s: float | None = None) -> None:
        """Deliver what is queued (bounded by ``send_timeout_s`` per alert), then stop."""
        self.queue.put(None)
        self.thread.join(self.cfg.send_timeout_s * 2 if timeout_s is None else timeout_s)
        if self.thread.is_alive():
            log.warning("alerts: delivery still running after the timeout; abandoned")

    def _work(self) -> None:
        while (alert := self.queue.get()) is not None:
            try:
                ok = self.deliver(alert)
            except Exception as err:
                ok = False
                log.warning("alerts: delivery of %s raised %s", alert.event, type(err).__name__)
            log.info("alerts: %s %s", alert.event, "delivered" if ok else "NOT delivered")


def build_notifier(cfg: AlertConfig, paths: RunPaths) -> Notifier:
    """The notifier of this run: URLs loaded and masked in logs; no URLs, no delivery."""
    urls = load_alert_urls(cfg, paths)
    install_redaction(urls)
    deliver = apprise_delivery(urls, cfg.send_timeout_s) if urls else None
    if urls:
        log.info("alerts: %s", ", ".join(describe_url(u) for u in urls))
    return Notifier(cfg, RateLimiter(cfg, AlertState(paths.alert_state)), deliver)
