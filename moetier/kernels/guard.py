"""A Triton kernel with its eager reference behind it: serving never fails on a kernel that fails.

Each kernel module keeps its own failure list (``_BROKEN``; tests read or set it): the first failure is noted there
and logged, and from then on that module's calls run the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def kernel_or_reference(
    broken: list[str], what: str, usable: bool, kernel: Callable[[], T], reference: Callable[[], T]
) -> T:
    """``kernel()`` where ``usable`` and nothing is in ``broken``; else, or if it raises (noted in ``broken``,
    logged naming ``what``), ``reference()``."""
    if usable and not broken:
        try:
            return kernel()
        except Exception as exc:  # noqa: BLE001 - a kernel failure must not take serving down
            broken.append(str(exc))
            log.warning("Triton %s failed (%s); using the eager path from now on", what, exc)
    return reference()
