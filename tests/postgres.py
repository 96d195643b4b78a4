"""A fresh Postgres cluster for tests: Debian's `postgresql` binaries (/usr/lib/postgresql/N/bin),
`initdb` into a temporary folder as a non-root user (`postgres` when the tests run as root; Postgres
refuses root), password authentication, listening on 127.0.0.1 and a free port only. `restart()`
stops it (fast shutdown) and starts it again on the same data and port."""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ports import free_port


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def _as_owner(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@dataclass
class Postgres:
    folder: Path
    port: int
    password: str
    user: str = "omni"
    proc: subprocess.Popen | None = None

    @property
    def data(self) -> Path:
        return self.folder / "data"

    def url(self, database: str, driver: str = "postgresql") -> str:
        return f"{driver}://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "PGPASSWORD": self.password, "PGHOST": "127.0.0.1", "PGPORT": str(self.port),
                "PGUSER": self.user}

    def start(self) -> Postgres:
        bin_ = pg_bin()
        log = open(self.folder / "postgres.log", "ab")  # noqa: SIM115 (the server's, closed with it)
        self.proc = subprocess.Popen(
            _as_owner([str(bin_ / "postgres"), "-D", str(self.data), "-p", str(self.port), "-h", "127.0.0.1",
                       "-k", str(self.folder / "sock")]),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while subprocess.run([str(bin_ / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                             capture_output=True).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start: {(self.folder / 'postgres.log').read_text()[-2000:]}")
            time.sleep(0.3)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def createdb(self, name: str) -> None:
        subprocess.run([str(pg_bin() / "createdb"), name], env=self.env(), check=True, capture_output=True)

    def dump(self, database: str) -> str:
        return subprocess.run([str(pg_bin() / "pg_dump"), database], env=self.env(), check=True,
                              capture_output=True, text=True).stdout

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_postgres(folder: Path) -> Postgres:
    """initdb + start; the folder is made the non-root owner's."""
    bin_ = pg_bin()
    if bin_ is None:
        raise RuntimeError("Debian's postgresql is not installed (apt-get install postgresql; `make setup` does)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sock").mkdir(exist_ok=True)
    pg = Postgres(folder, free_port(), secrets.token_urlsafe(16))
    pwfile = folder / "pw"
    pwfile.write_text(pg.password + "\n")
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
        shutil.chown(folder / "sock", "postgres")
        shutil.chown(pwfile, "postgres")
        os.chmod(folder.parent, 0o755)
    subprocess.run(_as_owner([str(bin_ / "initdb"), "-D", str(pg.data), "-U", pg.user, "-A", "scram-sha-256",
                              f"--pwfile={pwfile}", "--no-sync"]), check=True, capture_output=True)
    pwfile.unlink()
    return pg.start()
