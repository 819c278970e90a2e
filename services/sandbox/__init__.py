"""The code sandbox: a library environments and verifiers call, not a service.

``Sandbox`` runs a program under limits with the isolation this machine gives (``probe()``);
``checker`` scores a submitted module against hidden tests that never enter the sandbox.
"""

from rlbus.services.sandbox.sandbox import (
    Execution,
    Isolation,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxSettings,
    probe,
)

__all__ = ["Execution", "Isolation", "Sandbox", "SandboxError", "SandboxLimits", "SandboxSettings", "probe"]
