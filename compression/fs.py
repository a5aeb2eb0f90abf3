"""One file-system layer for local paths and object stores (``s3://``, ``gs://``, ``hdfs://``).

Every path compression/ and trainer/ take may be a local path or a URI that
``pyarrow.fs.FileSystem.from_uri`` understands::

    fs.expand("s3://logs/2024-05-*/part-*.parquet")   # sorted URIs of the matching objects
    with fs.open_input("s3://logs/x.parquet") as f:   # a pyarrow NativeFile
        ...
    fs.write_bytes("gs://models/run/result.json", data)

Credentials come from each store's standard environment and nowhere else: ``AWS_ACCESS_KEY_ID``
/ ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE`` / ``AWS_DEFAULT_REGION`` (``AWS_ENDPOINT_URL`` for
another S3-protocol server, e.g. MinIO) for S3, ``GOOGLE_APPLICATION_CREDENTIALS`` for GCS, the
Hadoop client's ``JAVA_HOME`` / ``HADOOP_HOME`` / ``CLASSPATH`` for HDFS. Nothing here logs or
stores them.

Object stores have no atomic rename of a directory, so a directory of outputs is published with
a manifest (:class:`StagedObjectOutput`): the files go under a unique hidden prefix
``DIR/.gen-XXXXXXXX/``, then ``DIR/_MANIFEST.json`` is written last, in one PUT, naming them.
Readers trust only what a manifest names: :func:`expand` of ``DIR``, ``DIR/*.parquet`` or
``DIR/_stats.json`` gives the files of the manifest's generation; files of a writer that
crashed stay hidden and the next publish in ``DIR`` removes them.

Failures of a store (a missing bucket, missing or refused credentials, a permission refusal, a
path that matches nothing) raise :class:`StorageError`: one line naming the path and what to do.
Local paths keep the operating system's own errors.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import threading
import uuid

import pyarrow as pa
import pyarrow.fs as pafs

from compression.errors import OutputExistsError, UsageError
from native.crash_points import crash_point

MANIFEST = "_MANIFEST.json"
MANIFEST_FORMAT = "prefixrec-manifest"
GENERATION_PREFIX = ".gen-"
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
_MAGIC = re.compile(r"[*?[]")


class StorageError(ValueError):
    """A path the store cannot serve, with what to do (a command prints it as one line)."""


class NoSuchPath(StorageError, FileNotFoundError):
    """A path or glob that names no file."""


# -- paths -----------------------------------------------------------------------------------

def scheme(path: str) -> str | None:
    """``s3``, ``gs``, ``hdfs``... of a URI; None for a local path (``file://`` included)."""
    match = _URI.match(os.fspath(path))
    if not match or match.group(1).lower() == "file":
        return None
    return match.group(1).lower()


def is_local(path) -> bool:
    return scheme(os.fspath(path)) is None


def local_path(path: str) -> str:
    """A local path without a ``file://`` scheme."""
    path = os.fspath(path)
    return path[len("file://"):] if path.lower().startswith("file://") else path


def join(base: str, *names: str) -> str:
    """``base/name/...``: with ``/`` for URIs, ``os.path.join`` for local paths."""
    base = os.fspath(base)
    if is_local(base):
        return os.path.join(base, *names)
    return "/".join([base.rstrip("/"), *(n.strip("/") for n in names)])


def dirname(path: str) -> str:
    path = os.fspath(path)
    if is_local(path):
        return os.path.dirname(path)
    head, _, _ = path.rstrip("/").rpartition("/")
    return head if "://" in head and not head.endswith(":/") else path


def basename(path: str) -> str:
    path = os.fspath(path)
    return os.path.basename(path) if is_local(path) else path.rstrip("/").rpartition("/")[2]


def has_magic(path: str) -> bool:
    return _MAGIC.search(os.fspath(path)) is not None


# -- file systems ----------------------------------------------------------------------------

_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
        "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
        "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GCE_METADATA_ROOT",
        "NO_GCE_CHECK", "HADOOP_HOME", "JAVA_HOME", "CLASSPATH")
# A GCS request, retries included, gives up after this many seconds. The client's default
# keeps retrying for minutes, also when it has no credentials at all: off Google Cloud it then
# asks the metadata server for a token again and again (measured here: no answer in 100 s).
GCS_RETRY_SECONDS = 30.0
_cache: dict = {}
_cache_lock = threading.Lock()


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """(file system, path inside it) of a local path or a URI. File systems are shared per
    store and per environment (a changed ``AWS_*`` variable gives a new one)."""
    path = os.fspath(path)
    kind = scheme(path)
    if kind is None:
        return pafs.LocalFileSystem(), os.path.abspath(local_path(path))
    _check_credentials(path, kind)
    netloc = _URI.match(path).group(2).partition("/")[0]
    # one per bucket (from_uri resolves the bucket's region) or name node
    key = (kind, netloc, tuple(os.environ.get(name) for name in _ENV), GCS_RETRY_SECONDS)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is None:
        try:
            if kind in ("gs", "gcs"):
                import datetime

                cached = pafs.GcsFileSystem(
                    retry_time_limit=datetime.timedelta(seconds=GCS_RETRY_SECONDS))
            else:
                cached, _ = pafs.FileSystem.from_uri(path)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise _storage_error(path, e) from None
        with _cache_lock:
            _cache[key] = cached
    inner = _URI.match(path).group(2)
    if kind == "hdfs" or kind == "viewfs":
        inner = "/" + inner.partition("/")[2]
    return cached, inner.rstrip("/") or inner


def _uri(path: str, inner: str) -> str:
    """The URI of ``inner`` (a path inside the file system of ``path``)."""
    match = _URI.match(path)
    if match is None:
        return inner
    kind, rest = match.group(1), match.group(2)
    if kind.lower() in ("hdfs", "viewfs"):
        return f"{kind}://{rest.partition('/')[0]}{inner}"
    return f"{kind}://{inner}"


def _check_credentials(path: str, kind: str) -> None:
    """Fail before any request when S3 or GCS has no credentials to find (the client would
    otherwise ask the cloud's metadata service and time out, or send anonymous requests):
    when the environment says this is not a cloud machine (``AWS_EC2_METADATA_DISABLED=true``,
    google-auth's ``NO_GCE_CHECK=true``) and no key or credentials file is set."""
    env = os.environ
    if kind in ("gs", "gcs"):
        if env.get("NO_GCE_CHECK", "").lower() != "true" or \
                env.get("GOOGLE_APPLICATION_CREDENTIALS"):
            return
        config = env.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
        if os.path.isfile(os.path.join(config, "application_default_credentials.json")):
            return
        raise StorageError(f"{path}: no GCS credentials: {_HINTS['gs']}")
    if kind != "s3" or os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        return
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_PROFILE") or \
            env.get("AWS_WEB_IDENTITY_TOKEN_FILE") or \
            env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or \
            env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return
    files = [env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials"),
             env.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")]
    if any(os.path.isfile(f) for f in files):
        return
    raise StorageError(f"{path}: no S3 credentials: set AWS_ACCESS_KEY_ID and "
                       "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment")


_HINTS = {
    "s3": ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and "
           "AWS_ENDPOINT_URL for an S3-compatible server"),
    "gs": ("set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file (or run "
           "gcloud auth application-default login)"),
    "hdfs": ("the HDFS client needs libhdfs and a JVM: set JAVA_HOME, HADOOP_HOME and "
             "CLASSPATH=$(hadoop classpath --glob)"),
}


def _storage_error(path: str, error: BaseException, doing: str = "",
                   known_only: bool = False) -> StorageError | None:
    """A store's failure as a :class:`StorageError` naming ``path`` and what to do (None
    with ``known_only`` when it is none of the failures this module knows)."""
    kind = scheme(path) or "file"
    kind = "gs" if kind == "gcs" else kind
    text = str(error)
    bucket = _URI.match(path).group(2).partition("/")[0] if _URI.match(path) else ""
    hint = _HINTS.get(kind, "check the path and the store's settings")
    if isinstance(error, FileNotFoundError) and "bucket" not in text.lower():
        return NoSuchPath(f"{path}: no such file or directory")
    if re.search(r"NO_SUCH_BUCKET|NoSuchBucket|[Bb]ucket '?[^ ]*'? (does not exist|not found)",
                 text):
        return StorageError(f"{path}: the bucket {bucket!r} does not exist; create it or "
                            "fix the path")
    if re.search(r"Could not create a OAuth2 access token|default credentials", text):
        return StorageError(f"{path}: no usable credentials for the store; {hint}")
    if re.search(r"INVALID_ACCESS_KEY_ID|InvalidAccessKeyId|SIGNATURE_DOES_NOT_MATCH|"
                 r"SignatureDoesNotMatch|EXPIRED_TOKEN|ExpiredToken|UNRECOGNIZED_CLIENT|"
                 r"[Cc]redentials|UNAUTHENTICATED|MISSING_AUTHENTICATION", text):
        return StorageError(f"{path}: the store refused the credentials; {hint}")
    ambiguous = "No response body" in text  # a HEAD request's 403 cannot tell which
    if not ambiguous and re.search(r"ACCESS_DENIED|AccessDenied|PERMISSION_DENIED|"
                                   r"Permission denied", text):
        return StorageError(f"{path}: permission refused{f' to {doing}' if doing else ''}; "
                            "give these credentials access to it, or use others")
    if ambiguous or re.search(r"HTTP status 403|response code 403|Forbidden|, 403\)", text):
        return StorageError(f"{path}: access refused{f' to {doing}' if doing else ''}: the "
                            "credentials are not allowed, or not valid for this store; "
                            f"{hint}")
    if kind == "hdfs" and re.search(r"libhdfs|libjvm|JAVA_HOME|HADOOP_HOME|CLASSPATH", text):
        return StorageError(f"{path}: cannot load the HDFS client; {hint}")
    if re.search(r"[Cc]ouldn't connect|Connection refused|curlCode|Unable to connect|"
                 r"Could not resolve host", text):
        endpoint = os.environ.get("AWS_ENDPOINT_URL") if kind == "s3" else None
        return StorageError(f"{path}: cannot reach the store"
                            f"{f' at {endpoint}' if endpoint else ''}; check the network and "
                            "the endpoint")
    if known_only:
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return StorageError(f"{path}: {doing + ' failed: ' if doing else ''}{first}")


class _errors:
    """``with _errors(path, "read it"):`` turns a remote store's errors into StorageError."""

    def __init__(self, path: str, doing: str = "", extra: tuple = ()):
        self.path = path
        self.doing = doing
        self.extra = extra

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or is_local(self.path) or isinstance(exc, StorageError):
            return False
        if isinstance(exc, (OSError, pa.ArrowException)):
            raise _storage_error(self.path, exc, self.doing) from None
        if isinstance(exc, self.extra):
            error = _storage_error(self.path, exc, self.doing, known_only=True)
            if error is not None:
                raise error from None
        return False


def translate_errors(path: str, doing: str = "", extra: tuple = ()):
    """A context manager that turns the failures of a remote store while working on ``path``
    into :class:`StorageError`: every ``OSError`` / Arrow error, and exceptions of the
    ``extra`` classes (another client's, e.g. Beam's file systems) whose message is a failure
    this module knows (a missing bucket, refused credentials or permission, no connection)."""
    return _errors(path, doing, extra)


# -- reading and writing ---------------------------------------------------------------------

def info(path: str) -> pafs.FileInfo:
    filesystem, inner = resolve(path)
    with _errors(path, "look it up"):
        return filesystem.get_file_info(inner)


def exists(path: str) -> bool:
    """Whether a file or directory is at ``path`` (for object stores: an object, or objects
    under the prefix ``path/``)."""
    if is_local(path):
        return os.path.exists(local_path(path))
    return info(path).type != pafs.FileType.NotFound


def isdir(path: str) -> bool:
    if is_local(path):
        return os.path.isdir(local_path(path))
    return info(path).type == pafs.FileType.Directory


def size(path: str) -> int:
    if is_local(path):
        return os.path.getsize(local_path(path))
    found = info(path)
    if found.type == pafs.FileType.NotFound:
        raise NoSuchPath(f"{path}: no such file")
    return found.size


@contextlib.contextmanager
def source(path: str, opener=None):
    """``with fs.source(path) as src: pq.ParquetFile(src)``: what pyarrow readers take for
    ``path``: the local path itself (their fastest and best-tested way), or an open
    random-access file of the store (or of ``opener()``), closed at the end of the block."""
    if opener is None and is_local(path):
        yield local_path(path)
        return
    file = opener() if opener is not None else open_input(path)
    try:
        yield file
    finally:
        file.close()


def open_input(path: str) -> pa.NativeFile:
    """A random-access file for reading (Parquet footers, seeks)."""
    filesystem, inner = resolve(path)
    with _errors(path, "read it"):
        return filesystem.open_input_file(inner)


def open_input_stream(path: str, compression: str | None = "detect") -> pa.NativeFile:
    """A sequential stream for reading; ``.gz`` and other known suffixes are decompressed."""
    filesystem, inner = resolve(path)
    with _errors(path, "read it"):
        return filesystem.open_input_stream(inner, compression=compression)


def open_output(path: str) -> pa.NativeFile:
    """A stream for writing ``path`` whole, the bytes as given (no compression by suffix). On
    object stores the object appears when the
    stream is closed, complete (one PUT or a completed multipart upload); locally it is written
    in place (use :func:`write_bytes` or a temp file + rename where a crash must not leave a
    half-written file)."""
    filesystem, inner = resolve(path)
    with _errors(path, "write it"):
        if is_local(path):
            filesystem.create_dir(os.path.dirname(inner), recursive=True)
        return filesystem.open_output_stream(inner, compression=None)


def read_bytes(path: str) -> bytes:
    if is_local(path):
        with open(local_path(path), "rb") as f:
            return f.read()
    with open_input_stream(path, compression=None) as f:
        with _errors(path, "read it"):
            return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


@contextlib.contextmanager
def replaced_atomically(path: str):
    """A temporary name beside the local file ``path``: what the block writes there becomes
    ``path`` when the block ends (fsynced, then renamed into place); on an error it is removed
    and ``path`` is left as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_bytes(path: str, data: bytes) -> str:
    """Write ``path`` whole, atomically: a temp file renamed into place locally, one object
    upload on a store."""
    if is_local(path):
        path = local_path(path)
        with replaced_atomically(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
        return path
    with open_output(path) as f, _errors(path, "write it"):
        f.write(data)
    return path


def write_text(path: str, text: str) -> str:
    return write_bytes(path, text.encode("utf-8"))


def list_files(directory: str, recursive: bool = True) -> list[str]:
    """The files under ``directory`` (URIs or local paths), sorted; [] when it does not exist."""
    filesystem, inner = resolve(directory)
    with _errors(directory, "list it"):
        found = filesystem.get_file_info(pafs.FileSelector(inner, allow_not_found=True,
                                                           recursive=recursive))
    local = is_local(directory)
    return sorted(f.path if local else _uri(directory, f.path) for f in found
                  if f.type == pafs.FileType.File)


def delete_tree(path: str) -> None:
    """Remove a directory (every object under the prefix) or a file; nothing if missing."""
    if is_local(path):
        import shutil

        path = local_path(path)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)
        return
    filesystem, inner = resolve(path)
    with _errors(path, "delete it"):
        found = filesystem.get_file_info(inner)
        if found.type == pafs.FileType.Directory:
            filesystem.delete_dir(inner)
        elif found.type == pafs.FileType.File:
            filesystem.delete_file(inner)


# -- globs -----------------------------------------------------------------------------------

def expand(pattern: str, directory_suffixes: tuple[str, ...] | None = None) -> list[str]:
    """The files a path, a directory or a glob names, sorted; :class:`NoSuchPath` when none.

    Globs follow Python's ``glob``: ``*``, ``?`` and ``[...]`` match within one path
    component, and names starting with ``.`` only when the pattern's component does. A
    directory gives its files whose names end with one of ``directory_suffixes`` (all files
    when None), except names starting with ``_`` or ``.``. On an object store a directory with
    a manifest (:class:`StagedObjectOutput`) gives the files the manifest names.
    """
    pattern = os.fspath(pattern)
    if is_local(pattern):
        files = _expand_local(local_path(pattern), directory_suffixes)
    else:
        files = _expand_remote(pattern, directory_suffixes)
        if not files:
            _check_bucket(pattern)
    if not files:
        raise NoSuchPath(f"no input files match {pattern!r}")
    return files


def _listed(path: str, suffixes) -> bool:
    name = basename(path)
    return not name.startswith(("_", ".")) and (suffixes is None or name.endswith(suffixes))


def _expand_local(path: str, suffixes) -> list[str]:
    import glob as globlib

    if os.path.isdir(path):
        return sorted(p for p in globlib.glob(os.path.join(path, "*")) if _listed(p, suffixes))
    if has_magic(path):
        return sorted(globlib.glob(path))
    return [path] if os.path.exists(path) else []


def _expand_remote(pattern: str, suffixes) -> list[str]:
    filesystem, inner = resolve(pattern)
    with _errors(pattern, "list it"):
        if not has_magic(inner):
            found = filesystem.get_file_info(inner)
            if found.type == pafs.FileType.File:
                return [pattern]
            if found.type == pafs.FileType.Directory:
                return [f for f in _directory_files(pattern, filesystem, inner)
                        if _listed(f, suffixes)]
            published = _published_path(pattern)  # DIR/_stats.json of a manifest
            return [published] if published else []
        parts = inner.split("/")
        first = next(i for i, part in enumerate(parts) if has_magic(part))
        if first == 0:
            raise StorageError(f"{pattern}: a glob in the bucket name is not supported; name "
                               "the bucket")
        candidates = [_published_directory(pattern, filesystem, "/".join(parts[:first]))]
        for depth in range(first, len(parts)):
            component, last = parts[depth], depth == len(parts) - 1
            matched = []
            for directory in candidates:
                if not has_magic(component):
                    matched.append(f"{directory}/{component}")
                    continue
                entries = _entries(pattern, filesystem, directory)
                for name, (kind, path) in entries.items():
                    if (fnmatch.fnmatchcase(name, component)
                            and (not name.startswith(".") or component.startswith("."))
                            and (kind == pafs.FileType.File if last
                                 else kind == pafs.FileType.Directory)):
                        matched.append(path)
            candidates = sorted(set(matched))
        if not has_magic(parts[-1]):  # a literal last component: keep what exists
            infos = filesystem.get_file_info(candidates)
            candidates = [i.path for i in infos if i.type == pafs.FileType.File]
    return sorted(_uri(pattern, c) for c in candidates)


def _check_bucket(path: str) -> None:
    """Raise :class:`StorageError` when the bucket of an object-store path does not exist
    (listings under a missing bucket are merely empty)."""
    kind = scheme(path)
    if kind not in ("s3", "gs", "gcs"):
        return
    filesystem, inner = resolve(path)
    bucket = inner.partition("/")[0]
    with _errors(path, "look it up"):
        missing = filesystem.get_file_info(bucket).type == pafs.FileType.NotFound
    if missing:
        raise StorageError(f"{path}: the bucket {bucket!r} does not exist; create it or fix "
                           "the path")


def _entries(pattern: str, filesystem, directory: str) -> dict[str, tuple]:
    """name -> (type, path) of a directory's entries; a directory with a manifest lists the
    files the manifest names (in their generation) instead of its own objects."""
    found = filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    names = {f.base_name: (f.type, f.path) for f in found}
    if MANIFEST in names and names[MANIFEST][0] == pafs.FileType.File:
        manifest = _read_manifest(_uri(pattern, names[MANIFEST][1]), filesystem,
                                  names[MANIFEST][1])
        generation = f"{directory}/{manifest['generation']}"
        entries = {}
        for name in manifest["files"]:  # a/b.jsonl: the directory a, in the generation
            top, slash, _ = name.partition("/")
            entries[top] = (pafs.FileType.Directory if slash else pafs.FileType.File,
                            f"{generation}/{top}")
        return entries
    return names


def _published_directory(pattern: str, filesystem, inner: str) -> str:
    """``inner`` if it is a directory, else where a manifest in its parent or grandparent
    puts it (``DIR/_dead_letter`` of a published ``DIR``); ``inner`` when none does."""
    parts = inner.split("/")
    if len(parts) == 1 or filesystem.get_file_info(inner).type == pafs.FileType.Directory:
        return inner  # a bucket, or a directory of its own
    for up in (1, 2):
        if len(parts) - up < 1:
            break
        ancestor, rest = "/".join(parts[:-up]), "/".join(parts[-up:])
        manifest_path = f"{ancestor}/{MANIFEST}"
        if filesystem.get_file_info(manifest_path).type == pafs.FileType.File:
            manifest = _read_manifest(_uri(pattern, manifest_path), filesystem, manifest_path)
            if any(name.startswith(rest + "/") for name in manifest["files"]):
                return f"{ancestor}/{manifest['generation']}/{rest}"
            break
    return inner


def _directory_files(pattern: str, filesystem, inner: str) -> list[str]:
    entries = _entries(pattern, filesystem, inner)
    return sorted(_uri(pattern, path) for _, (kind, path) in entries.items()
                  if kind == pafs.FileType.File)


def _read_manifest(uri: str, filesystem, inner: str) -> dict:
    with filesystem.open_input_stream(inner, compression=None) as f:
        data = f.read()
    try:
        manifest = json.loads(data)
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(
                manifest.get("files"), dict) or not str(
                manifest.get("generation", "")).startswith(GENERATION_PREFIX):
            raise ValueError("not a prefixrec manifest")
    except (ValueError, AttributeError) as e:
        raise StorageError(f"{uri}: damaged manifest ({e}); rewrite the output") from None
    return manifest


def _published_path(path: str) -> str | None:
    """Where a file that is not there by its own name lives in a published directory: the
    parent's or grandparent's manifest may name it (``DIR/_stats.json``,
    ``DIR/_dead_letter/x.jsonl``)."""
    directory, name = dirname(path), basename(path)
    for _ in range(2):
        if directory == path or "://" not in directory:
            return None
        filesystem, inner = resolve(directory)
        manifest_path = f"{inner}/{MANIFEST}"
        if filesystem.get_file_info(manifest_path).type == pafs.FileType.File:
            manifest = _read_manifest(join(directory, MANIFEST), filesystem, manifest_path)
            if name in manifest["files"]:
                return join(directory, manifest["generation"], name)
            return None
        directory, name = dirname(directory), f"{basename(directory)}/{name}"
    return None


def resolve_published(path: str) -> str:
    """``path`` itself if it exists, else where a manifest above it says the file lives."""
    if is_local(path):
        return path
    filesystem, inner = resolve(path)
    with _errors(path, "look it up"):
        if filesystem.get_file_info(inner).type == pafs.FileType.File:
            return path
        published = _published_path(path)
    if published is None:
        raise NoSuchPath(f"{path}: no such file")
    return published


# -- publishing a directory on an object store -----------------------------------------------

def published_manifest(directory: str) -> dict | None:
    """The manifest of a published object-store directory, or None."""
    filesystem, inner = resolve(directory)
    with _errors(directory, "read its manifest"):
        if filesystem.get_file_info(f"{inner}/{MANIFEST}").type != pafs.FileType.File:
            return None
        return _read_manifest(join(directory, MANIFEST), filesystem, f"{inner}/{MANIFEST}")


class StagedObjectOutput:
    """An object-store directory published all or nothing, the object-store form of
    :class:`compression.outputs.StagedOutput` (same ``path`` / ``tmp`` / ``commit`` /
    ``discard``).

    Write into ``tmp`` (``DIR/.gen-XXXXXXXX``, a prefix readers never look in); :meth:`commit`
    writes ``DIR/_MANIFEST.json`` naming every file under it (one PUT: readers see the old
    generation or the new one, never a mix), then removes older generations and any other
    object left in ``DIR`` by an earlier output (with ``overwrite``). :meth:`discard` removes
    ``tmp``. A writer that dies leaves only its hidden generation, which the next commit in
    ``DIR`` removes.
    """

    def __init__(self, path: str, overwrite: bool = False, flag: str = "--output", inputs=()):
        self.path = path.rstrip("/")
        self.overwrite = overwrite
        self.flag = flag
        for inner in inputs:
            if os.fspath(inner) == self.path or os.fspath(inner).startswith(self.path + "/"):
                raise UsageError(f"{flag} {path}: holds the input {inner}, which writing the "
                                 "output there would replace; choose another directory")
        _check_bucket(self.path)  # before any work: a listing under a missing bucket is empty
        self.check()
        self.generation = f"{GENERATION_PREFIX}{uuid.uuid4().hex[:8]}"
        self.tmp = join(self.path, self.generation)
        self.committed = False

    def check(self) -> None:
        """Refuse a directory that holds an output unless ``overwrite`` (leftovers of writers
        that died do not count)."""
        if self.overwrite:
            return
        filesystem, inner = resolve(self.path)
        with _errors(self.path, "list it"):
            found = filesystem.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
        kept = [f for f in found if not f.base_name.startswith(GENERATION_PREFIX)]
        if kept:
            raise OutputExistsError(
                f"{self.flag} {self.path}: the directory is not empty ({len(kept)} entr"
                f"{'y' if len(kept) == 1 else 'ies'}); pass --overwrite to replace it whole, "
                "or choose another directory")

    def commit(self) -> str:
        self.check()  # another job may have published meanwhile
        filesystem, inner = resolve(self.path)
        tmp_inner = f"{inner}/{self.generation}"
        with _errors(self.path, "publish it"):
            found = filesystem.get_file_info(pafs.FileSelector(tmp_inner, recursive=True,
                                                               allow_not_found=True))
            files = {f.path[len(tmp_inner) + 1:]: f.size for f in found
                     if f.type == pafs.FileType.File}
            manifest = {"format": MANIFEST_FORMAT, "version": 1,
                        "generation": self.generation, "files": dict(sorted(files.items()))}
            crash_point("publish.copied")  # see native.crash_points
            with filesystem.open_output_stream(f"{inner}/{MANIFEST}", compression=None) as f:
                f.write(json.dumps(manifest, indent=1).encode())
        self.committed = True
        crash_point("publish.committed")
        self._remove_others(filesystem, inner)
        return self.path

    def _remove_others(self, filesystem, inner: str) -> None:
        """Everything in the directory but the manifest and this generation: older
        generations, a writer's leftovers, and (``overwrite``) the old output's own files.
        Best effort: what stays is hidden from readers."""
        try:
            found = filesystem.get_file_info(pafs.FileSelector(inner))
            for entry in found:
                if entry.base_name in (MANIFEST, self.generation):
                    continue
                if entry.type == pafs.FileType.Directory:
                    filesystem.delete_dir(entry.path)
                else:
                    filesystem.delete_file(entry.path)
        except (OSError, pa.ArrowException):
            pass

    def discard(self) -> None:
        if not self.committed:
            try:
                delete_tree(self.tmp)
            except StorageError:
                pass

    def __enter__(self) -> "StagedObjectOutput":
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or not self.committed:
            self.discard()
        return False


def publish_directory(local_dir: str, directory: str, overwrite: bool = True,
                      flag: str = "--output") -> str:
    """Publish the local directory ``local_dir`` (every file under it) as the object-store
    directory ``directory``, all or nothing (:class:`StagedObjectOutput`): the files are
    copied under a hidden generation, then the manifest naming them is written last. With
    ``overwrite`` (the default) an older output there is replaced whole."""
    staged = StagedObjectOutput(directory, overwrite=overwrite, flag=flag)
    with staged:
        upload_directory(local_dir, staged.tmp, doing="publish it", reported=directory)
        staged.commit()
    return staged.path


def upload_directory(local_dir: str, directory: str, doing: str = "upload it",
                     reported: str | None = None) -> None:
    """Copy every file under the local directory ``local_dir`` to the object-store directory
    ``directory``, keeping relative paths; the files are streamed, several at once (no whole
    file in memory). Nothing marks them published: the caller writes its manifest last.
    Errors name ``reported`` (default ``directory``)."""
    filesystem, inner = resolve(directory)
    with _errors(reported or directory, doing):
        pafs.copy_files(os.path.abspath(local_path(local_dir)), inner,
                        source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=filesystem)


@contextlib.contextmanager
def working_copy(directory: str, download: bool = True):
    """A local temporary directory to work in for the object-store ``directory``: with
    ``download``, holding the files its manifest names (empty when nothing is published
    there); removed at the end of the block. What the block wants kept it publishes with
    :func:`publish_directory` (for consumers that write local files: checkpoints, TensorBoard
    logs, native snapshots)."""
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="prefixrec-work-")
    local = os.path.join(work, basename(directory.rstrip("/")) or "dir")
    try:
        if download and published_manifest(directory) is not None:
            download_published(directory, local)
        os.makedirs(local, exist_ok=True)
        yield local
    finally:
        shutil.rmtree(work, ignore_errors=True)


def download_published(directory: str, local_dir: str) -> str:
    """Copy the files the manifest of the published object-store ``directory`` names into the
    local directory ``local_dir`` (created), keeping their relative paths; returns
    ``local_dir``. :class:`NoSuchPath` when nothing is published there. For consumers that
    must read local files (native libraries, TensorFlow's SavedModel loader)."""
    manifest = published_manifest(directory)
    if manifest is None:
        raise NoSuchPath(f"{directory}: nothing published there ({MANIFEST} missing)")
    local_dir = os.path.abspath(local_path(local_dir))
    for name in manifest["files"]:
        download_file(join(directory, manifest["generation"], name),
                      os.path.join(local_dir, *name.split("/")), reported=join(directory, name))
    return local_dir


def download_file(uri: str, target: str, reported: str | None = None) -> str:
    """Copy the object ``uri`` to the local file ``target`` (its directory created), streamed;
    errors name ``reported`` (default ``uri``)."""
    filesystem, inner = resolve(uri)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    with _errors(reported or uri, "download it"):
        pafs.copy_files(inner, os.path.abspath(target), source_filesystem=filesystem,
                        destination_filesystem=pafs.LocalFileSystem())
    return target


def check_bucket(path: str) -> None:
    """Raise :class:`StorageError` now when the bucket of an object-store path does not exist
    (for a command that writes there only at its end); nothing for other paths."""
    if not is_local(path):
        _check_bucket(path)
