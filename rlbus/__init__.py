"""rlbus: asynchronous RL post-training of LLMs as independent services over NATS JetStream.

The import names live under this package while the code stays in the top-level folders the
design lays out: ``rlbus.bus`` is ``bus/``, ``rlbus.schemas`` is ``schemas/``, ``rlbus.services``
is ``services/`` and ``rlbus.observability`` is ``observability/`` (pyproject.toml maps them).
Nothing else is put on the import path, so rlbus installs beside PyPI's ``bus``, ``schemas`` or
``services`` without either shadowing the other.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("rlbus")
except _metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
