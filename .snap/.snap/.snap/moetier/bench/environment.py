"""What a benchmark receipt records about where and how it ran."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

_PACKAGES = ("torch", "triton", "transformers", "accelerate", "safetensors", "tokenizers", "numpy", "moetier")


def git_sha() -> str | None:
    """The commit being measured: ``MOETIER_GIT_SHA`` (set when the tree travels without .git), else git."""
    if sha := os.environ.get("MOETIER_GIT_SHA"):
        return sha
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu() -> dict:
    info: dict = {"count": os.cpu_count(), "machine": platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name") and "model" not in info:
                info["model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["flags"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
                break
    except OSError:
        pass
    return info


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _gpu() -> dict | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    info = {"name": props.name, "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}"}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    return info


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["torch"] = torch.__version__
    return versions


_SKIP = ("MOETIER_GIT_SHA", "MOETIER_RESULTS")  # recorded elsewhere, or only where files go


def environment() -> dict:
    """Git sha, command line, hardware (GPU, driver, CPU flags, RAM) and package versions."""
    return {
        "git_sha": git_sha(),
        "command": " ".join(sys.argv),
        "host": platform.node(),
        "kernel": platform.release(),  # tells the lent machines' runtimes apart (gVisor reports 4.4.0)
        "gpu": _gpu(),
        "cpu": _cpu(),
        "ram_bytes": _ram_bytes(),
        "versions": _versions(),
        # The knobs that change which code runs (graphs, Triton, the CPU kernel), as they were set.
        "moetier_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOETIER_") and k not in _SKIP},
    }
