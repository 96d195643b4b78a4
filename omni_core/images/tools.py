"""Running the external tools (buildah, docker, skopeo): logs, tails, and telling transient failures apart."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from omni_core.images.errors import ImageBuildError

# What to install when a tool is missing (Debian package names).
PACKAGES = {"buildah": "buildah", "skopeo": "skopeo", "docker": "docker.io (with the buildx plugin)",
            "docker-registry": "docker-registry", "busybox": "busybox-static"}

# Network and registry failures that may pass on a later try (Go net errors, HTTP 429/5xx).
TRANSIENT = re.compile(
    r"connection refused|connection reset|i/o timeout|timeout exceeded|TLS handshake timeout|no such host|"
    r"temporary failure in name resolution|network is unreachable|unexpected EOF|broken pipe|"
    r"too many requests|\b429\b|\b50[0234]\b|service unavailable|bad gateway|gateway timeout|"
    r"server misbehaving|deadline exceeded",
    re.IGNORECASE,
)
TAIL_LINES = 25


def require(tool: str) -> str:
    """The path of `tool`, or an ImageBuildError naming the package that provides it."""
    path = shutil.which(tool)
    if path is None:
        raise ImageBuildError(f"{tool} is not installed; install the {PACKAGES.get(tool, tool)} package "
                              f"(Debian: apt-get install {PACKAGES.get(tool, tool).split()[0]})")
    return path


def run_logged(argv: Sequence[str], log: Path, on_line: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Run `argv`, appending its merged output to `log`; return (exit code, last lines of output)."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                tail.append(line.rstrip("\n"))
                if on_line is not None:
                    on_line(line.rstrip("\n"))
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return code, "\n".join(tail)


def run_quiet(argv: Sequence[str], timeout: float = 120) -> tuple[int, bytes, str]:
    """Run a short command: (exit code, stdout bytes, stderr text). A timeout counts as transient."""
    try:
        result = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"{' '.join(argv[:3])} did not finish within {timeout:.0f} s") from exc
    return result.returncode, result.stdout, result.stderr.decode(errors="replace")
