"""Where a run's files are: a local folder, or objects in a store by URL (s3://, gs://, az://, hf://)."""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from rlscope.errors import RlscopeError

#: The stores a run is read from by URL: each read by pyarrow's filesystem for it (listing,
#: footers) and by Polars' own reader (the scans), both taking credentials from the store's
#: standard environment and config files; rlscope never sees, prints or keeps them.
SCHEMES = {
    "s3": "Amazon S3 or any S3 API (AWS_* variables, ~/.aws; AWS_ENDPOINT_URL for another "
    "endpoint)",
    "gs": "Google Cloud Storage (application default credentials)",
    "gcs": "Google Cloud Storage (application default credentials)",
    "az": "Azure Blob Storage (AZURE_STORAGE_ACCOUNT_NAME and the Azure credential chain)",
    "hf": "Hugging Face Hub (hf://datasets/ORG/NAME/...; HF_TOKEN; needs huggingface_hub)",
}
#: Attempts per request to a store (a throttled or dropped request is tried again, at most
#: this many times in all); a missing object, a bucket or a denied key is not retried.
ATTEMPTS = 3
#: Seconds to connect to a store, and to wait for a request's answer.
CONNECT_TIMEOUT = 5.0
REQUEST_TIMEOUT = 60.0
#: Requests in flight at once when listing folders or reading footers.
CONCURRENCY = 16

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, order=True)
class StorePath:
    """An object, or a folder (a key prefix), in a store: what the reader does with a Path
    (`/`, name, parent, relative_to), never opened as a local file."""

    scheme: str
    key: str  # "bucket/folder/file.parquet": no leading or trailing slash

    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(self.scheme, f"{self.key}/{name.strip('/')}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StorePath:
        return StorePath(self.scheme, self.key.rsplit("/", 1)[0])

    @property
    def bucket(self) -> str:
        return self.key.split("/", 1)[0]

    def resolve(self) -> StorePath:
        return self

    def relative_to(self, other: StorePath) -> PurePosixPath:
        if other.scheme != self.scheme or not self.key.startswith(other.key + "/"):
            raise ValueError(f"{self} is not under {other}")
        return PurePosixPath(self.key[len(other.key) + 1 :])


#: A run's location, and each of its files'.
RunPath = Path | StorePath


def relative(path: RunPath, folder: RunPath) -> PurePosixPath | Path:
    """`path` relative to `folder` (ValueError when it is not under it, or in another store)."""
    if isinstance(path, StorePath) and isinstance(folder, StorePath):
        return path.relative_to(folder)
    if isinstance(path, Path) and isinstance(folder, Path):
        return path.relative_to(folder)
    raise ValueError(f"{path} is not under {folder}")


def is_url(location: str | os.PathLike[str] | StorePath) -> bool:
    """Whether `location` is a URL (of a store, or file://) rather than a local path."""
    return isinstance(location, StorePath) or "://" in str(location)


def location(text: str | os.PathLike[str] | StorePath) -> RunPath:
    """The one place that reads a run's location: a store's URL as a StorePath, a file:// URL
    or a path as a local Path."""
    if isinstance(text, StorePath | Path):
        return text
    text = os.fspath(text)
    if "://" not in text:
        return Path(text)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise RlscopeError(f"{text}: a file:// URL names a local path (file:///path)")
        return Path(unquote(parts.path))
    if scheme not in SCHEMES:
        raise RlscopeError(
            f"{text}: unknown store `{scheme}://`",
            hint="rlscope reads " + ", ".join(f"{s}://" for s in SCHEMES) + " and local paths",
        )
    key = f"{parts.netloc}/{parts.path.strip('/')}".strip("/")
    if not parts.netloc or not key:
        raise RlscopeError(f"{text}: no bucket in the URL", hint=f"{scheme}://BUCKET/path/to/run")
    return StorePath("gs" if scheme == "gcs" else scheme, key)


def polars_options(path: RunPath) -> dict[str, Any] | None:
    """Polars' `storage_options` for a file at `path` (None: a local file): bounded retries,
    and no credential (Polars reads the store's own environment and config)."""
    if not isinstance(path, StorePath):
        return None
    return {"max_retries": ATTEMPTS - 1, "retry_timeout_ms": int(REQUEST_TIMEOUT * 1000)}


def arrow_source(path: RunPath) -> tuple[str, Any]:
    """What pyarrow opens `path` with: its path and filesystem (None: a local file)."""
    if not isinstance(path, StorePath):
        return str(path), None
    return path.key, filesystem(path)


_filesystems: dict[tuple[str, str, str], Any] = {}
_SETTINGS = ("AWS_", "GOOGLE_", "GCS_", "AZURE_", "HF_")
_lock = threading.Lock()


def filesystem(path: StorePath) -> Any:
    """pyarrow's filesystem of `path`'s store, made once per process and bucket (a cluster's
    worker makes its own, from its own environment)."""
    # The environment is part of the key: a filesystem reads its endpoint and credentials
    # when it is made.
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith(_SETTINGS))
    name = (path.scheme, path.bucket if path.scheme in ("s3", "az") else "", repr(settings))
    with _lock:
        if name not in _filesystems:
            _filesystems[name] = _new_filesystem(path)
        return _filesystems[name]


def _new_filesystem(path: StorePath) -> Any:
    import pyarrow.fs as pafs

    if path.scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if not region and not endpoint:
            try:
                region = pafs.resolve_s3_region(path.bucket)
            except OSError:
                region = None  # the AWS SDK's own guess (~/.aws/config, else us-east-1)
        return pafs.S3FileSystem(
            region=region,
            endpoint_override=endpoint or None,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=ATTEMPTS),
            connect_timeout=CONNECT_TIMEOUT,
            request_timeout=REQUEST_TIMEOUT,
        )
    if path.scheme == "gs":
        from datetime import timedelta

        return pafs.GcsFileSystem(retry_time_limit=timedelta(seconds=REQUEST_TIMEOUT))
    if path.scheme == "az":
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        if not account:
            raise RlscopeError(
                f"{path}: no Azure storage account",
                hint="set AZURE_STORAGE_ACCOUNT_NAME (az://CONTAINER/path names the container)",
            )
        return pafs.AzureFileSystem(account_name=account)
    try:
        from huggingface_hub import HfFileSystem
    except ImportError:
        raise RlscopeError(
            f"{path}: reading the Hugging Face Hub needs huggingface_hub",
            hint="pip install huggingface_hub",
        ) from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem()))


@dataclass(frozen=True)
class StoreObject:
    """A listed object: its path, size and modification time (as the listing says)."""

    path: StorePath
    size: int
    mtime_ns: int


def list_folder(folder: StorePath, *, recursive: bool) -> list[StoreObject] | None:
    """The objects under `folder` (None when it holds none: no such folder), sorted."""
    import pyarrow.fs as pafs

    fs = filesystem(folder)
    try:
        infos = fs.get_file_info(pafs.FileSelector(folder.key, recursive=recursive))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise store_error(folder, exc) from None
    found = [
        StoreObject(StorePath(folder.scheme, info.path.strip("/")), info.size, info.mtime_ns or 0)
        for info in infos
        if info.type == pafs.FileType.File
    ]
    return sorted(found, key=lambda o: o.path) or None


def list_folders(folders: Sequence[StorePath]) -> list[list[StoreObject] | None]:
    """`list_folder` (recursive) of each folder, the listings in flight at once."""
    return concurrently(lambda f: list_folder(f, recursive=True), folders)


def open_object(path: StorePath) -> tuple[Any, int]:
    """The object opened for reading (a pyarrow file: ranged reads), and a digest of its
    version as the store names it (ETag, generation or version id; else its modification
    time), which changes whenever the object is rewritten."""
    try:
        handle = filesystem(path).open_input_file(path.key)
        meta = handle.metadata() or {}
    except OSError as exc:
        raise store_error(path, exc) from None
    # pyarrow's metadata: str or bytes keys (by store), bytes values.
    fields = {_text(k).lower(): _text(v) for k, v in meta.items()}
    tag = next(
        (fields[k] for k in ("etag", "generation", "versionid", "last-modified") if k in fields),
        "",
    )
    return handle, int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=7).digest(), "big")


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def read_object(path: StorePath) -> bytes:
    """A small object's bytes (run.json)."""
    try:
        with filesystem(path).open_input_stream(path.key) as stream:
            return bytes(stream.read())
    except OSError as exc:
        raise store_error(path, exc) from None


def mirror(source: StorePath, into: Path) -> Path:
    """A local copy in `into` of `source` (a folder's objects, or one object), for readers that
    need whole local files (the importers); the copy's path is returned. Only objects whose
    size or modification time changed since the last copy are fetched (CONCURRENCY at once);
    objects gone from the store leave the copy. Nothing is written to the store."""
    import json

    listed = list_folder(source, recursive=True)
    base = source
    if listed is None:  # one object, or nothing
        try:
            info = filesystem(source).get_file_info(source.key)
        except OSError as exc:
            raise store_error(source, exc) from None
        if info.size is None or not info.is_file:
            raise RlscopeError(f"{source}: no such object or folder in the store")
        listed, base = [StoreObject(source, info.size, info.mtime_ns or 0)], source.parent
    # The copy bears the folder's name (importers name the run after it), the stamps beside it.
    copy, stamps_file = into / base.name, into / "stamps.json"
    try:
        stamps = json.loads(stamps_file.read_text())
    except (OSError, ValueError):
        stamps = {}
    wanted: dict[str, StoreObject] = {}
    for found in listed:
        rel = found.path.relative_to(base)
        if rel.parts and ".." not in rel.parts:  # a key never leads out of the copy
            wanted[rel.as_posix()] = found
    stale = [
        (rel, found)
        for rel, found in wanted.items()
        if stamps.get(rel) != [found.size, found.mtime_ns] or not (copy / rel).is_file()
    ]
    concurrently(lambda item: _fetch(item[1], copy / item[0]), stale)
    for rel in set(stamps) - set(wanted):
        (copy / rel).unlink(missing_ok=True)
    into.mkdir(parents=True, exist_ok=True)
    stamps_file.write_text(json.dumps({r: [o.size, o.mtime_ns] for r, o in wanted.items()}))
    return copy if base == source else copy / source.name


def _fetch(found: StoreObject, dest: Path) -> None:
    """One object streamed to `dest` (a partial download never takes its name)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        with (
            filesystem(found.path).open_input_stream(found.path.key) as source,
            open(tmp, "wb") as out,
        ):
            while chunk := source.read(1 << 22):
                out.write(chunk)
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise store_error(found.path, exc) from None


def concurrently(work: Callable[[T], R], items: Iterable[T], threads: int = CONCURRENCY) -> list[R]:
    """`work` on each item, `threads` at a time (by default CONCURRENCY: requests to a store
    wait on the network), the results in order; the first error in order is raised."""
    items = list(items)
    if len(items) <= 1 or threads <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(work, items))


#: What a store's error says (its words, lower case, without spaces or punctuation: pyarrow's
#: `AWS Error ACCESS_DENIED`, Polars' `AccessDenied`), the cause and what to do; first match.
_CAUSES = (
    (
        (
            "accessdenied",
            "invalidaccesskeyid",
            "signaturedoesnotmatch",
            "expiredtoken",
            "invalidtoken",
            "forbidden",
            "unauthorized",
            "unauthenticated",
            "permissiondenied",
            "credential",
        ),
        "access denied",
        "check the store's credentials in the environment or its config files (for S3: "
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and ~/.aws)",
    ),
    (
        ("nosuchbucket", "bucketdoesnotexist", "bucketnotfound"),
        "the bucket does not exist",
        "check the bucket's name (and AWS_ENDPOINT_URL for another S3 endpoint)",
    ),
    (
        (
            "networkconnection",
            "couldnotconnect",
            "connectionrefused",
            "connectionreset",
            "failedtoconnect",
            "timedout",
            "timeout",
            "errorsendingrequest",
        ),
        "the store did not answer",
        "check the endpoint (AWS_ENDPOINT_URL for another S3 endpoint) and the network; "
        f"each request was tried {ATTEMPTS} times",
    ),
    (
        ("nosuchkey", "nosuchfile", "notfound", "doesnotexist"),
        "no such object",
        "the object was removed or renamed since the run was listed; re-run",
    ),
)


def store_error(path: StorePath | str, exc: BaseException) -> RlscopeError:
    """A failed request to a store as an RlscopeError naming the URL and, when the store's
    message says it, the cause and what to do."""
    text = re.sub(r"\s*\(Request ID: [^)]*\)", "", " ".join(str(exc).split()))
    words = re.sub(r"[^a-z]", "", text.lower())
    for keys, cause, hint in _CAUSES:
        if any(key in words for key in keys):
            return RlscopeError(f"{path}: {cause} ({_short(text)})", hint=hint)
    return RlscopeError(f"{path}: the store failed ({_short(text)})", hint="re-run")


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
