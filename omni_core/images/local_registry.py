"""A throwaway registry on 127.0.0.1 (Debian's docker-registry, i.e. CNCF distribution) for tests,
benchmarks and trying `omni image build --push` without a real registry."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from omni_core.images.tools import require


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRegistry:
    """`with LocalRegistry(tmp_dir) as registry:` -> "127.0.0.1:PORT", storage under tmp_dir."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        binary = require("docker-registry")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(f"version: 0.1\nlog: {{level: warn}}\n"
                          f"storage: {{filesystem: {{rootdirectory: {self.root / 'data'}}}, delete: {{enabled: true}}}}\n"
                          f"http: {{addr: '{self.address}'}}\n")
        log = open(self.root / "registry.log", "wb")  # noqa: SIM115 - closed with the process
        self._proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 20
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self._proc.returncode}: "
                                   f"{(self.root / 'registry.log').read_text()[-1500:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self.address
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"docker-registry did not listen on {self.address} within 20 s") from None
                time.sleep(0.05)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
