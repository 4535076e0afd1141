"""Building the CPU tier's C kernel: the system C compiler, the cache of builds, the key that names one.

The source (``cpu_experts.c``, with the ``cpu_*.c`` parts it includes: :data:`INCLUDED`) ships with the
package and is compiled on first use with ``$CC``, else Python's configured compiler, else ``cc``/``gcc``, into
``$XDG_CACHE_HOME/moetier/kernels`` (default ``~/.cache/moetier/kernels``). The file name hashes the
sources, the flags, the compiler and the CPU, so a changed source or another host never loads a stale
build; the build writes a temporary file and renames it, so concurrent builders are safe.
:mod:`moetier.kernels.cpu_experts` loads what :func:`build` returns.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_experts.c")
# The files SOURCE #includes (one translation unit): a build depends on them too.
INCLUDED = tuple(SOURCE.with_name(n) for n in ("cpu_experts_fp4.c", "cpu_job.c", "cpu_team.c", "cpu_worker.c"))
FLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300


def compiler() -> list[str]:
    """The C compiler command: ``$CC``, else Python's configured ``CC``, else ``cc`` or ``gcc`` on PATH."""
    candidates = [os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc"]
    for candidate in candidates:
        words = shlex.split(candidate) if candidate else []
        if words and shutil.which(words[0]):
            return words
    raise RuntimeError("no C compiler found ($CC, Python's CC, cc and gcc are all missing)")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moetier" / "kernels"


def _cpu_identity() -> str:
    """The CPU model and flags: ``-march=native`` builds differ between hosts that share a home directory."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted))


def build_key(cc: list[str], flags: tuple[str, ...]) -> str:
    """Hash of everything the built file depends on: sources, flags, compiler (and its version), machine."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(SOURCE.read_bytes())
    for included in INCLUDED:
        digest.update(b"\0" + included.read_bytes())
    for part in (" ".join(flags), " ".join(cc), version, platform.machine(), _cpu_identity()):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:20]


def build(extra_flags: tuple[str, ...] = ()) -> Path:
    """Path of the shared library, compiling it when this key was never built; RuntimeError on failure."""
    cc = compiler()
    flags = FLAGS + tuple(extra_flags)
    target = cache_dir() / f"cpu_experts-{build_key(cc, flags)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [*cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip())
            raise RuntimeError(f"{' '.join(cc)} failed (exit {done.returncode}): {first}")
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file may be replaced, never torn
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
