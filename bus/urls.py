"""NATS server URLs: one, or several separated by commas (the members of a cluster).

``nats://a:4222,nats://b:4222,nats://c:4222`` is how a cluster is named in one config value or one
environment variable (``RLBUS_RUN__NATS_URL``); the client tries them in turn and reconnects to
whichever is up.  Parsed here, without a connection, so a config is refused at start-up with the
member that is wrong.
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
                f"{url!r} is not a NATS server URL: write scheme://host:port with scheme one of "
                f"{', '.join(SCHEMES)} (e.g. nats://127.0.0.1:4222); separate the members of a cluster "
                "with commas")
    return urls
