"""NATS server URLs: one, or several separated by commas (the members of a cluster).

``nats://a:4222,nats://b:4222,nats://c:4222`` is how a cluster is named in one config value or one
environment variable (``RLBUS_RUN__NATS_URL``); the client tries them in turn and reconnects to
whichever is up.  Parsed here, without a connection, so a config is refused at start-up with the
member that is wrong.

A URL may carry ``user:password@``; ``redact_url`` strips that before a URL is logged or put in an
error (prefer ``[run] nats_password_file`` or ``RLBUS_NATS_PASSWORD``: see ``rlbus.bus.credentials``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

SCHEMES = ("nats", "tls", "ws", "wss")


class BadServerURL(ValueError):
    pass


def server_urls(value: str) -> list[str]:
    """The URLs in ``value`` (comma-separated), each checked; raises ``BadServerURL`` naming the bad one."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        raise BadServerURL("no NATS server URL given; e.g. nats://127.0.0.1:4222 (start one with `rlbus nats`)")
    for url in urls:
        parts = urlsplit(url)
        try:
            parts.port  # noqa: B018 - raises for a port that is no number or out of range
        except ValueError:
            ok = False
        else:
            ok = parts.scheme in SCHEMES and bool(parts.hostname)
        if not ok:
            raise BadServerURL(
                f"{redact_url(url)!r} is not a NATS server URL: write scheme://host:port with scheme one of "
                f"{', '.join(SCHEMES)} (e.g. nats://127.0.0.1:4222); separate the members of a cluster "
                "with commas")
    return urls


def redact_url(value: str) -> str:
    """``value`` (one URL or a comma-separated cluster) with any ``user:password@`` removed, for logs
    and error messages: a URL may carry a password, and a log line is no place for one."""
    out = []
    for url in value.split(","):
        parts = urlsplit(url.strip())
        if parts.username is None and parts.password is None:
            out.append(url.strip())
            continue
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 literal keeps its brackets
            host = f"[{host}]"
        try:
            port = parts.port
        except ValueError:
            port = None
        netloc = f"***@{host}" + (f":{port}" if port is not None else "")
        out.append(parts._replace(netloc=netloc).geturl())
    return ",".join(out)


def url_user(value: str) -> str | None:
    """The user named by the first URL in ``value`` that names one, or None."""
    return next((n for u in value.split(",") if (n := urlsplit(u.strip()).username)), None)


def url_has_userinfo(value: str) -> bool:
    """Whether any URL in ``value`` carries a user (and maybe a password) of its own."""
    return url_user(value) is not None
