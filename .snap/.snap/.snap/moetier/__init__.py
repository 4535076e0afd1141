"""moetier: serve giant Mixture-of-Experts LLMs from one GPU plus host RAM and NVMe.

``from moetier import LLM, SamplingParams`` is the offline API. The names load on first use, so
``import moetier`` (and ``moetier --help``) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("moetier")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

_LAZY = {
    "LLM": "moetier.llm",
    "RequestOutput": "moetier.llm",
    "CompletionOutput": "moetier.llm",
    "SamplingParams": "moetier.engine.sampling",
}

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from moetier.engine.sampling import SamplingParams
    from moetier.llm import LLM, CompletionOutput, RequestOutput


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'moetier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
