"""A URI-addressed object store: a local directory or an ``s3://bucket/prefix``.

Keys are relative posix paths under the store root (``datasets/gsm8k/abc/_manifest.json``).
Every write is atomic: an object appears under its final name only once it is complete.

- Local: bytes go to a hidden temp file in the target directory (``.{name}.tmp-{hex}``), which is
  fsynced and then ``os.replace``-d onto the final name. ``list()`` never shows temp files.
- S3: an object only becomes visible when its PUT or multipart upload completes, so writes stream
  through s3fs and, on an exception, the upload is aborted instead of completed. (A process killed
  mid-upload leaves an incomplete multipart upload, invisible to readers; a bucket lifecycle rule
  ``AbortIncompleteMultipartUpload`` reclaims its parts.)

S3 settings come from the standard AWS environment variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``) and
``OMNI_S3_ENDPOINT_URL`` (which takes precedence over ``AWS_ENDPOINT_URL``) for S3-compatible stores.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
from botocore.exceptions import (
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from fsspec.implementations.local import LocalFileSystem

from omni_core.errors import StorageError

log = logging.getLogger(__name__)

ENDPOINT_ENV = "OMNI_S3_ENDPOINT_URL"
S3_PART_SIZE = 8 * 2**20  # multipart part size (and write buffer); 10,000 parts -> objects up to ~80 GB
S3_CONNECT_TIMEOUT_S = 2
S3_READ_TIMEOUT_S = 20
S3_ATTEMPTS = 3  # s3fs-level attempts (connection errors, 5xx); botocore itself does not retry (no retries of retries)
S3_PUT_CONCURRENCY = 10  # parts of one file in flight in put_file (boto3's TransferConfig default)
CHUNK = 2**20
_TEMP_NAME = re.compile(r"^\..*\.tmp-[0-9a-f]{32}$")
_UNREACHABLE = (BotoConnectionError, HTTPClientError, TimeoutError)
_NO_CREDENTIALS = (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)


_SERVER_SIDE = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"}
_TRANSIENT_STATUS = {500, 502, 503, 504}  # not 501 NotImplemented: asking again would not change the answer


def _server_side_error(exc: BaseException) -> bool:
    """An S3 answer that says "try again" (500/502/503/504, InternalError, ServiceUnavailable): S3 asks clients to
    retry these, and every request the store makes is safe to repeat (a PUT writes the same bytes)."""
    if not isinstance(exc, ClientError):
        return False
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status in _TRANSIENT_STATUS or exc.response.get("Error", {}).get("Code") in _SERVER_SIDE


def _install_s3fs_retry() -> None:
    """Have s3fs retry server-side errors too (it retries only connection errors and SlowDown by itself,
    and botocore's own retries stay off here: no retries of retries). s3fs takes one process-wide handler,
    so one installed before ours is kept and asked first."""
    import s3fs.core  # here, not at the top: a local store never loads s3fs and aiobotocore

    earlier = s3fs.core.CUSTOM_ERROR_HANDLER
    if getattr(earlier, "omni_retry", False):
        return

    def retry(exc: BaseException) -> bool:
        return bool(earlier(exc)) or _server_side_error(exc)

    retry.omni_retry = True  # type: ignore[attr-defined]
    s3fs.core.set_custom_error_handler(retry)


def _modified(info: dict[str, Any]) -> float:
    """An fsspec listing entry's last-modified time: `mtime` (local, seconds) or `LastModified` (s3fs)."""
    if "mtime" in info:
        return float(info["mtime"])
    stamp = info.get("LastModified")
    return stamp.timestamp() if hasattr(stamp, "timestamp") else 0.0


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """A key that does not exist was read (also a ``FileNotFoundError``)."""


class Store:
    """Atomic, streamed reads and writes of keys under one root (local path, file:// or s3://)."""

    def __init__(self, root: str) -> None:
        if not isinstance(root, str) or not root.strip():
            raise StorageError(
                f"store root {root!r} is empty; set `store:` to a local path or s3://bucket/prefix"
            )
        scheme = urlsplit(root).scheme if "://" in root else ""
        self._bucket: str | None = None
        self._prefix = ""
        self.endpoint: str | None = None
        self._client: Any = None  # boto3 S3 client for put_file, made on first use
        if scheme == "s3":
            bucket, _, prefix = root[len("s3://") :].partition("/")
            if not bucket:
                raise StorageError(f"store root {root!r} names no bucket; use s3://bucket/prefix")
            self._bucket, self._prefix = bucket, prefix.strip("/")
            self.root = f"s3://{bucket}" + (f"/{self._prefix}" if self._prefix else "")
            self._fs: Any = self._make_s3()
        elif scheme in ("", "file"):
            local = root[len("file://") :] if scheme == "file" else root
            self._local = os.path.abspath(os.path.expanduser(local))
            self.root = f"file://{self._local}" if scheme == "file" else self._local
            self._fs = LocalFileSystem()
        else:
            raise StorageError(
                f"store root {root!r} has unsupported scheme {scheme!r}; use a local path, file:// or s3://"
            )

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    # ---- addressing -------------------------------------------------------------------------

    def uri(self, key: str) -> str:
        key = _clean_key(key)
        return f"{self.root}/{key}" if key else self.root

    def _path(self, key: str) -> str:
        """The filesystem path of a (clean) key: ``bucket/prefix/key`` or ``/abs/root/key``."""
        base = f"{self._bucket}/{self._prefix}".rstrip("/") if self._bucket else self._local
        return f"{base}/{key}" if key else base

    # ---- reads --------------------------------------------------------------------------------

    def read_bytes(self, key: str) -> bytes:
        key = _clean_key(key, empty_ok=False)
        with self._errors(key):
            return self._fs.cat_file(self._path(key))

    def open_read(self, key: str) -> IO[bytes]:
        """A seekable binary file, read lazily; use it as a context manager."""
        key = _clean_key(key, empty_ok=False)
        with self._errors(key):
            return self._fs.open(self._path(key), "rb")

    def read_text(self, key: str) -> str:
        return self.read_bytes(key).decode("utf-8")

    def read_json(self, key: str) -> Any:
        return json.loads(self.read_bytes(key))

    def exists(self, key: str) -> bool:
        key = _clean_key(key)
        with self._errors(key):
            return bool(self._fs.exists(self._path(key)))

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys under ``prefix`` (a key or a folder of keys), recursively; no temp files."""
        return sorted(self.list_modified(prefix))

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """The keys of `list` with each one's last-modified time (seconds since the epoch, as the store
        records it: a local file's mtime, an S3 object's LastModified, whole seconds), from the one
        listing: no read of each object."""
        prefix = _clean_key(prefix)
        with self._errors(prefix):
            found = self._fs.find(self._path(prefix), detail=True)
        base = self._path("") + "/"
        modified = {}
        for path, info in found.items():
            key = path[len(base) :]
            if (not path.startswith(base) or path.endswith("/") or _TEMP_NAME.match(key.rsplit("/", 1)[-1])
                    or (prefix and key != prefix and not key.startswith(prefix + "/"))):
                continue
            modified[key] = _modified(info)
        return modified

    def sha256(self, key: str) -> str:
        digest = hashlib.sha256()
        with self.open_read(key) as f, self._errors(key):
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    # ---- writes -------------------------------------------------------------------------------

    @contextmanager
    def open_write(self, key: str) -> Iterator[IO[bytes]]:
        """Stream bytes to ``key``; the object appears only if the with-block exits cleanly.

        On an exception nothing is visible under the final name and a previous version stays
        intact. Closing the yielded file (as ``pyarrow.parquet.ParquetWriter.close`` does) does
        not commit; leaving the with-block does.
        """
        key = _clean_key(key, empty_ok=False)
        f, commit, abort = self._local_staged(key) if self._bucket is None else self._s3_staged(key)
        sink = _Sink(f)
        try:
            yield sink  # type: ignore[misc]
        except BaseException:
            sink.detach()
            abort()
            raise
        sink.detach()
        with self._errors(key):
            try:
                commit()
            except BaseException:
                abort()
                raise

    @contextmanager
    def write_path(self, key: str) -> Iterator[str]:
        """A local file path to create ``key`` through, for writers that want a real file (pyarrow's
        native writer copies nothing through Python); committed, like ``open_write``, only if the
        with-block exits cleanly.

        Local stores stage next to the final name (fsync + rename); S3 stores stage in a local temp
        folder and upload on commit.
        """
        key = _clean_key(key, empty_ok=False)
        if self._bucket is None:
            final = self._path(key)
            parent, name = os.path.split(final)
            with self._errors(key):
                os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f".{name[:180]}.tmp-{uuid.uuid4().hex}")
            try:
                yield tmp
                with self._errors(key):
                    fd = os.open(tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.replace(tmp, final)
                    _fsync_dir(parent)
            finally:
                with suppress(FileNotFoundError):
                    os.remove(tmp)
            return
        with tempfile.TemporaryDirectory(prefix="omni-store-") as folder:
            tmp = os.path.join(folder, "object")
            yield tmp
            with open(tmp, "rb") as src, self.open_write(key) as dst:
                shutil.copyfileobj(src, dst, CHUNK)

    def put_file(self, path: str | os.PathLike[str], key: str) -> None:
        """Upload the local file `path` to `key`; the object appears whole or not at all. On S3 boto3's
        managed transfer (one PUT, or a multipart upload with S3_PUT_CONCURRENCY parts in flight,
        aborted on failure; measured faster than s3fs's put_file against the same server:
        bench/verl_launcher.py); locally a staged copy renamed into place."""
        key = _clean_key(key, empty_ok=False)
        if self._bucket is None:
            with open(path, "rb") as src, self.open_write(key) as dst:
                shutil.copyfileobj(src, dst, CHUNK)
            return
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=S3_PART_SIZE, multipart_chunksize=S3_PART_SIZE,
                                max_concurrency=S3_PUT_CONCURRENCY)
        with self._errors(key):
            try:
                self._boto3().upload_file(os.fspath(path), self._bucket, self._path(key).split("/", 1)[1],
                                          Config=config)
            except Exception as exc:  # boto3 wraps the client's error: translate the cause
                raise (exc.__context__ if isinstance(exc.__context__, Exception) else exc) from None

    def _boto3(self) -> Any:
        """A boto3 S3 client with the settings of the s3fs filesystem (endpoint, region, timeouts)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            endpoint = os.environ.get(ENDPOINT_ENV) or os.environ.get("AWS_ENDPOINT_URL") or None
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
            self._client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name=region,
                config=Config(connect_timeout=S3_CONNECT_TIMEOUT_S, read_timeout=S3_READ_TIMEOUT_S,
                              retries={"total_max_attempts": S3_ATTEMPTS, "mode": "standard"}))
        return self._client

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.open_write(key) as f:
            f.write(data)

    def write_text(self, key: str, text: str) -> None:
        self.write_bytes(key, text.encode("utf-8"))

    def write_json(self, key: str, obj: Any) -> None:
        self.write_text(key, json.dumps(obj, sort_keys=True, indent=2) + "\n")

    def delete(self, key_or_prefix: str) -> None:
        """Delete an object, or everything under a prefix; a missing key is not an error."""
        key = _clean_key(key_or_prefix, empty_ok=False)
        path = self._path(key)
        with self._errors(key), suppress(FileNotFoundError):
            if self._bucket is None:
                self._fs.rm(path, recursive=True)
            else:  # the object itself, and the "folder" of that name (but not "key2/...")
                targets = [p for p in self._fs.find(path) if p == path or p.startswith(path + "/")]
                if targets:
                    self._fs.rm(targets)

    # ---- health check -------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Write, read back and delete a probe object; raise StorageError saying what is wrong."""
        if self._bucket is None:
            self._check_local_root()
        else:
            self._check_bucket()
        probe = f"_omni_probe/{uuid.uuid4().hex}"
        payload = os.urandom(16)
        self.write_bytes(probe, payload)
        try:
            if self.read_bytes(probe) != payload:
                raise StorageError(
                    f"{self.uri(probe)} read back different bytes than written; check the store"
                )
        finally:
            self.delete(probe)
            if self._bucket is None:
                with suppress(OSError):
                    os.rmdir(self._path("_omni_probe"))

    def _check_local_root(self) -> None:
        root = Path(self._local)
        blocker = root
        while not blocker.exists() and blocker != blocker.parent:
            blocker = blocker.parent
        if not blocker.is_dir():
            raise StorageError(
                f"store root {root} cannot be a directory because {blocker} is a regular file; "
                "remove that file or choose another store path"
            )
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create store root {root} ({exc.strerror}); choose another store path"
            ) from exc
        if not os.access(root, os.W_OK | os.X_OK):
            raise StorageError(
                f"store root {root} is not writable; fix its permissions or choose another store path"
            )

    def _check_bucket(self) -> None:
        try:
            self._fs.call_s3("head_bucket", Bucket=self._bucket)
        except FileNotFoundError as exc:
            raise StorageError(
                f"S3 bucket {self._bucket!r} does not exist at {self._where()}; "
                f"create it (aws s3 mb s3://{self._bucket}) or fix the store root {self.root}"
            ) from exc
        except PermissionError as exc:
            raise StorageError(
                f"access to S3 bucket {self._bucket!r} at {self._where()} is denied; check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket policy"
            ) from exc
        except Exception as exc:
            raise self._translate(exc, self.root) from exc

    # ---- backends -----------------------------------------------------------------------------

    def _make_s3(self) -> Any:
        _install_s3fs_retry()
        endpoint = os.environ.get(ENDPOINT_ENV) or os.environ.get("AWS_ENDPOINT_URL") or None
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        self.endpoint = _redact(endpoint) if endpoint else None
        fs = fsspec.filesystem(
            "s3",
            endpoint_url=endpoint,
            client_kwargs={"region_name": region} if region else {},
            config_kwargs={
                "connect_timeout": S3_CONNECT_TIMEOUT_S,
                "read_timeout": S3_READ_TIMEOUT_S,
                "retries": {"total_max_attempts": 1, "mode": "standard"},
            },
            default_block_size=S3_PART_SIZE,
            use_listings_cache=False,  # other processes write too: never answer from a stale listing
            skip_instance_cache=True,  # a fresh client per Store: no state shared across endpoints
        )
        fs.retries = S3_ATTEMPTS
        return fs

    def _local_staged(self, key: str) -> tuple[Any, Callable[[], None], Callable[[], None]]:
        """A temp file next to the final name, how to commit it, and how to abort it."""
        final = self._path(key)
        parent, name = os.path.split(final)
        with self._errors(key):
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f".{name[:180]}.tmp-{uuid.uuid4().hex}")
            f = open(tmp, "wb")  # noqa: SIM115 - closed by commit/abort below

        def commit() -> None:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, final)
            _fsync_dir(parent)

        def abort() -> None:
            f.close()
            with suppress(FileNotFoundError):
                os.remove(tmp)

        return f, commit, abort

    def _s3_staged(self, key: str) -> tuple[Any, Callable[[], None], Callable[[], None]]:
        """A streaming S3 upload, how to complete it, and how to abort it."""
        with self._errors(key):
            f = self._fs.open(self._path(key), "wb", block_size=S3_PART_SIZE)

        def abort() -> None:  # never complete the upload: abort the multipart upload, if any
            try:
                f.discard()
            except Exception as exc:  # the original error matters more
                log.warning("could not abort the upload of %s: %s", self.uri(key), type(exc).__name__)
            finally:
                f.closed = True

        return f, f.close, abort

    # ---- errors -------------------------------------------------------------------------------

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Turn backend exceptions into one-line StorageErrors naming the URI and the fix."""
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            raise self._translate(exc, self.uri(key)) from exc

    def _translate(self, exc: Exception, uri: str) -> StorageError:
        s3 = self._bucket is not None
        if s3 and isinstance(exc, _UNREACHABLE):
            return StorageError(
                f"cannot reach S3 endpoint {self._where()} for {uri} ({type(exc).__name__}); "
                f"start the service or set {ENDPOINT_ENV} to a reachable endpoint"
            )
        if s3 and isinstance(exc, _NO_CREDENTIALS):
            return StorageError(
                f"no usable S3 credentials for {uri} at {self._where()}; "
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN if temporary)"
            )
        if isinstance(exc, FileNotFoundError):
            hint = f" (or bucket {self._bucket!r} is missing)" if s3 else ""
            return ObjectNotFoundError(f"no such object {uri}{hint}; check the key and the store root")
        if isinstance(exc, PermissionError):
            fix = (
                "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket policy"
                if s3
                else "fix the permissions or choose another store root"
            )
            return StorageError(f"permission denied for {uri}; {fix}")
        if isinstance(exc, NotADirectoryError | FileExistsError) and not s3:
            return StorageError(
                f"cannot store {uri}: a regular file is in the way; remove it or choose another store root"
            )
        detail = str(exc).splitlines()[0][:200] if str(exc) else ""
        return StorageError(f"{uri}: {type(exc).__name__}: {detail}; check the store root and its settings")

    def _where(self) -> str:
        return self.endpoint or "the default AWS S3 endpoint"


def open_store(root: str) -> Store:
    return Store(root)


POINTER_ROUNDS = 20  # each a read after a writer's write; two writers settle in two or three


def settle_pointer(store: Store, key: str, newest: Callable[[], str | None]) -> str | None:
    """Points the text object `key` (a LATEST pointer) at `newest()`, what the store's committed objects
    name (the newest committed checkpoint step, the dataset version committed last), until a round
    with no write in between agrees: the pointer read, `newest()` read from the store, the pointer read
    again and unchanged. A store has no compare-and-set; two writers that each wrote their own value
    (one of them stale) settle this way on the newest, whoever wrote last: the pointer never ends on an
    older commit because of a race. Returns the value it ends on."""
    def read() -> str | None:
        try:
            return store.read_text(key).strip() or None
        except ObjectNotFoundError:
            return None

    current: str | None = None
    for _ in range(POINTER_ROUNDS):
        current = read()
        wanted = newest()
        if read() != current:
            continue  # moved by another writer meanwhile: evaluate again
        if wanted is None or current == wanted:
            return current
        store.write_text(key, wanted + "\n")
    return current


class _Sink(io.RawIOBase):
    """The writable face of a staged object: closing it flushes but does not commit."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self._f: Any = f

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._f is None or self.closed:
            raise ValueError("write to a closed store object")
        self._f.write(data)
        return memoryview(data).nbytes

    def tell(self) -> int:
        if self._f is None:
            raise ValueError("tell on a closed store object")
        return self._f.tell()

    def flush(self) -> None:
        if self._f is not None and not self.closed:
            self._f.flush()

    def detach(self) -> None:  # type: ignore[override]
        """Close this view without touching the staged object (open_write commits or aborts it)."""
        self._f = None
        self.close()


def _clean_key(key: str, empty_ok: bool = True) -> str:
    if not isinstance(key, str):
        raise StorageError(
            f"store key {key!r} is not a string; pass a relative path like 'datasets/x/y.json'"
        )
    if key.startswith("/") or "://" in key:
        raise StorageError(f"store key {key!r} is absolute; pass a path relative to the store root")
    parts = [p for p in key.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise StorageError(f"store key {key!r} contains '..'; pass a path inside the store root")
    if not parts and not empty_ok:
        raise StorageError(f"store key {key!r} is empty; pass a path relative to the store root")
    return "/".join(parts)


def _fsync_dir(path: str) -> None:
    with suppress(OSError):  # not supported everywhere (e.g. Windows); the rename is done anyway
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _redact(url: str) -> str:
    """Drop any user:password@ from an endpoint URL before it is shown anywhere."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit(parts._replace(netloc=netloc))
    return url
