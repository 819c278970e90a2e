"""Who a connection is to the NATS server, and over what: user/password, a creds file (JWT), an
nkey seed, TLS.  Built from the run config (``RunSettings.bus_options``) or, for the CLI tools that
take no run config, from the environment (``Credentials.from_env``).

Secrets never sit in a config file: a password comes from a file (``[run] nats_password_file``) or
from ``RLBUS_NATS_PASSWORD``; ``rlbus auth init`` writes one ``<role>.env`` per role with both the
user and the password.  A user connecting with ``nats_user`` gets its own inbox prefix
``_INBOX.<user>`` so the server can confine each role's replies to its own inboxes (another role
cannot subscribe to them and read, say, the trainer's pulled batches).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbus.bus.protocol import BusError

PASSWORD_ENV = "RLBUS_NATS_PASSWORD"
# The CLI tools (publish, status, streams, control) read the same variables the run config does.
_ENV_KEYS = {
    "user": "RLBUS_RUN__NATS_USER", "password_file": "RLBUS_RUN__NATS_PASSWORD_FILE",
    "creds_file": "RLBUS_RUN__NATS_CREDS_FILE", "nkey_seed_file": "RLBUS_RUN__NATS_NKEY_SEED_FILE",
    "tls_ca": "RLBUS_RUN__NATS_TLS_CA", "tls_cert": "RLBUS_RUN__NATS_TLS_CERT", "tls_key": "RLBUS_RUN__NATS_TLS_KEY",
}


def inbox_prefix(user: str) -> str:
    """The reply inboxes of a named user: ``Connection.open`` sets it, ``rlbus auth init`` grants
    each role subscriptions under its own and no other."""
    return f"_INBOX.{user}"


class CredentialsError(BusError):
    """A credential file is missing or unreadable, or the server refused the credentials."""


def read_secret(path: str, key: str) -> str:
    """The first line of a secret file; the error names the config key that pointed to it."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as exc:
        raise CredentialsError(f"[run] {key} = {path!r} cannot be read ({exc.strerror}); "
                               "point it at the file `rlbus auth init` wrote") from None
    secret = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not secret:
        raise CredentialsError(f"[run] {key} = {path!r} is empty; it must hold the password on its first line")
    return secret


@dataclass(frozen=True)
class Credentials:
    """What ``nats-py`` needs to log in.  ``source`` says where the password came from, so a refusal
    names the key to check."""

    user: str | None = None
    password: str | None = None
    source: str = ""  # "[run] nats_password_file", "RLBUS_NATS_PASSWORD", ...
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __repr__(self) -> str:  # never a password in a traceback or a log line
        return f"Credentials(user={self.user!r}, password={'***' if self.password else None}, source={self.source!r})"

    @classmethod
    def build(cls, *, user: str | None = None, password_file: str | None = None, creds_file: str | None = None,
              nkey_seed_file: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
              tls_key: str | None = None) -> Credentials:
        """From config values: the password from ``password_file``, else from ``RLBUS_NATS_PASSWORD``."""
        password, source = None, ""
        if password_file:
            password, source = read_secret(password_file, "nats_password_file"), "[run] nats_password_file"
        elif os.environ.get(PASSWORD_ENV):
            password, source = os.environ[PASSWORD_ENV].strip(), PASSWORD_ENV
        if password and not user:
            raise CredentialsError(f"a NATS password is set ({source}) but no user: set [run] nats_user "
                                   "(or RLBUS_RUN__NATS_USER) to the role it belongs to")
        if bool(tls_cert) != bool(tls_key):
            raise CredentialsError("[run] nats_tls_cert and nats_tls_key go together: set both (client "
                                   "certificate) or neither (server-verified TLS with nats_tls_ca only)")
        return cls(user=user or None, password=password, source=source, creds_file=creds_file or None,
                   nkey_seed_file=nkey_seed_file or None, tls_ca=tls_ca or None, tls_cert=tls_cert or None,
                   tls_key=tls_key or None)

    @classmethod
    def from_env(cls) -> Credentials:
        """For tools without a run config: the ``RLBUS_RUN__NATS_*`` and ``RLBUS_NATS_PASSWORD`` variables."""
        return cls.build(**{k: os.environ.get(v) or None for k, v in _ENV_KEYS.items()})

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of ``nats.NATS.connect``."""
        out: dict[str, Any] = {}
        if self.user:
            out["user"] = self.user
            if self.password:
                out["password"] = self.password
        for path, key in ((self.creds_file, "nats_creds_file"), (self.nkey_seed_file, "nats_nkey_seed_file")):
            if path and not Path(path).expanduser().is_file():
                raise CredentialsError(f"[run] {key} = {path!r} is not a file; point it at the file your "
                                       "NATS account tooling wrote")
        if self.creds_file:
            out["user_credentials"] = str(Path(self.creds_file).expanduser())
        if self.nkey_seed_file:
            out["nkeys_seed"] = str(Path(self.nkey_seed_file).expanduser())
        if self.tls_ca or self.tls_cert:
            out["tls"] = self.tls_context()
        return out

    def tls_context(self) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise CredentialsError(f"cannot load the TLS files ([run] nats_tls_ca = {self.tls_ca!r}, nats_tls_cert = "
                                   f"{self.tls_cert!r}, nats_tls_key = {self.tls_key!r}): {exc}") from None
        return ctx

    def what_to_check(self, url_has_user: bool) -> str:
        """The keys a refused login should make the user check."""
        if self.creds_file:
            return "check [run] nats_creds_file"
        if self.nkey_seed_file:
            return "check [run] nats_nkey_seed_file"
        if self.user:
            where = self.source or f"no password was given: set [run] nats_password_file or {PASSWORD_ENV}"
            return f"check [run] nats_user = {self.user!r} and the password ({where})"
        if url_has_user:
            return "check the user:password in the NATS URL"
        return (f"the server wants credentials: set [run] nats_user with nats_password_file (or {PASSWORD_ENV}), "
                "e.g. from the <role>.env file `rlbus auth init` wrote")
