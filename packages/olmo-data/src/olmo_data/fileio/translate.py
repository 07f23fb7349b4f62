"""Storage failures as one line: a client's or the OS's exception becomes the `StorageError`
that names the path and the fix (missing or rejected credentials, an unknown bucket, a denied
permission, an unreachable endpoint, a missing file)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from .clients import _filesystem
from .errors import (
    BucketNotFoundError,
    StorageCredentialsError,
    StorageError,
    StorageNetworkError,
    StorageNotFoundError,
    StoragePermissionError,
)
from .names import PathArg, _bucket, _split, is_remote, normalize


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and everything it was raised from (s3fs re-raises botocore's errors)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


# Matched by class name (across each class's bases) so that neither botocore nor gcsfs nor
# aiohttp need be installed to import this module.
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
_GOOGLE_AUTH = {"DefaultCredentialsError", "RefreshError"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403", "Forbidden"}
_NETWORK = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectionError",  # aiohttp: refused, reset, server disconnected
    "ServerTimeoutError",
    "FSTimeoutError",
    "ConnectionError",  # the builtin (refused, reset) and requests'
    "TimeoutError",
}
_PERMISSION = {
    ("s3", "read"): "s3:GetObject",
    ("s3", "stat"): "s3:GetObject",
    ("s3", "list"): "s3:ListBucket",
    ("s3", "write"): "s3:PutObject",
    ("s3", "delete"): "s3:DeleteObject",
    ("gs", "read"): "storage.objects.get",
    ("gs", "stat"): "storage.objects.get",
    ("gs", "list"): "storage.objects.list",
    ("gs", "write"): "storage.objects.create",
    ("gs", "delete"): "storage.objects.delete",
}


def _endpoint(scheme: str, fs: Any) -> str:
    if scheme == "s3":
        client = getattr(fs, "s3", None)  # set once s3fs has connected
        url = getattr(getattr(client, "meta", None), "endpoint_url", None)
        url = url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return f"the S3 endpoint {url}" if url else "the S3 endpoint"
    location = getattr(fs, "_location", None) or os.environ.get("STORAGE_EMULATOR_HOST")
    return f"the GCS endpoint {location}" if location else "the GCS endpoint"


def _bucket_missing(scheme: str, fs: Any, bucket: str) -> bool:
    """Whether the bucket is known not to exist (False when it exists or cannot be told)."""
    try:
        if scheme == "s3":
            fs.call_s3("head_bucket", Bucket=bucket)
        else:
            fs.call("GET", "b/{}", bucket, json_out=True)
    except FileNotFoundError:
        return True
    except Exception:  # no right to read bucket metadata, a network error: cannot tell
        return False
    return False


def _s3_rejection(fs: Any, bucket: str) -> str | None:
    """The error code if S3 rejects these credentials outright. A HEAD answers a bare 403 for
    unknown keys and for missing permissions alike; a one-key listing carries the reason."""
    try:
        fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
    except Exception as e:  # the listing itself may be denied: then nothing is learnt
        for c in _chain(e):
            response = getattr(c, "response", None)
            code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
            if code in _BAD_CREDENTIALS:
                return code
    return None


def _no_bucket(url: str, fs: Any) -> BucketNotFoundError:
    scheme = url.split("://", 1)[0]
    knob = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
    return BucketNotFoundError(
        f"{url}: bucket {_bucket(url)!r} does not exist at {_endpoint(scheme, fs)}; check the bucket name "
        f"(and {knob} if set)"
    )


def _check_bucket(url: str, fs: Any) -> None:
    """Raise BucketNotFoundError if the bucket of `url` does not exist. For listings that came
    back empty: the clients list a missing bucket as an empty one."""
    if _bucket_missing(url.split("://", 1)[0], fs, _bucket(url)):
        raise _no_bucket(url, fs)


def _local_error(exc: BaseException, path: str, op: str) -> StorageError | None:
    """The StorageError for an OS error on a local path; it keeps the OS's errno (a caller
    that names the reason, "Permission denied", reads it there)."""
    if isinstance(exc, FileNotFoundError):
        err: StorageError = StorageNotFoundError(f"{path}: no such file; check the path")
    elif isinstance(exc, PermissionError):
        err = StoragePermissionError(f"{path}: permission denied ({op}); fix the file's permissions or the path")
    elif isinstance(exc, IsADirectoryError):
        err = StorageError(f"{path}: is a folder, not a file; name a file inside it")
    else:
        return None
    if isinstance(err, OSError):
        err.errno = exc.errno
    return err


def _codes(chain: list[BaseException]) -> set[str]:
    """The error codes the chain carries: botocore's response code, gcsfs's HTTP status."""
    codes = set()
    for e in chain:
        response = getattr(e, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            codes.add(str(response["Error"].get("Code")))
        code = getattr(e, "code", None)  # gcsfs HttpError
        if isinstance(code, int):
            codes.add(str(code))
    return codes


def _credentials_error(
    exc: BaseException, url: str, fs: Any, names: set[str], codes: set[str], text: str
) -> StorageCredentialsError | None:
    """StorageCredentialsError when the credentials are missing or rejected, else None."""
    scheme, bucket = url.split("://", 1)[0], _bucket(url)
    if scheme == "s3" and (names & _NO_CREDENTIALS):
        return StorageCredentialsError(
            f"{url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE, or run where an instance or container role provides them)"
        )
    rejected = codes & _BAD_CREDENTIALS
    if scheme == "s3" and not rejected and "403" in codes:
        rejected = {code} if (code := _s3_rejection(fs, bucket)) else set()
    if scheme == "s3" and rejected:
        return StorageCredentialsError(
            f"{url}: {_endpoint(scheme, fs)} rejected the credentials ({', '.join(sorted(rejected))}); "
            "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (or AWS_PROFILE) and AWS_ENDPOINT_URL"
        )
    anonymous = scheme == "gs" and getattr(getattr(fs, "credentials", None), "credentials", object()) is None
    if scheme == "gs" and (
        names & _GOOGLE_AUTH
        or "401" in codes
        or (_forbidden(exc, codes) and anonymous and not os.environ.get("STORAGE_EMULATOR_HOST"))
    ):
        return StorageCredentialsError(
            f"{url}: no usable Google Cloud credentials ({text}); run `gcloud auth application-default login` "
            "or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file"
        )
    return None


def _forbidden(exc: BaseException, codes: set[str]) -> bool:
    return bool(codes & _DENIED) or isinstance(exc, PermissionError) or str(exc).startswith("Forbidden")


def _translate(exc: BaseException, url: str, op: str, fs: Any) -> StorageError | None:
    """The StorageError for a client or OS exception, or None for one that is not a storage
    failure (a bug: it propagates unchanged)."""
    if isinstance(exc, StorageError):
        return exc
    if not is_remote(url):
        return _local_error(exc, url, op)
    chain = _chain(exc)
    names = {c.__name__ for e in chain for c in type(e).__mro__}
    codes = _codes(chain)
    # The root cause says most ("[Errno 111] Connect call failed ..."); its wrappers repeat it.
    said = [e for e in chain if str(e).strip()]
    text = str(said[-1]).splitlines()[0][:200] if said else type(exc).__name__
    if (credentials := _credentials_error(exc, url, fs, names, codes, text)) is not None:
        return credentials
    scheme, bucket = url.split("://", 1)[0], _bucket(url)
    if "NoSuchBucket" in codes:
        return _no_bucket(url, fs)
    if _forbidden(exc, codes):
        permission = _PERMISSION.get((scheme, op), "access")
        # S3 answers 403, not 404, for a missing key to a caller who may not list the bucket.
        missing = scheme == "s3" and op in ("read", "stat")
        hint = " (or the object does not exist and s3:ListBucket is not granted)" if missing else ""
        return StoragePermissionError(
            f"{url}: permission denied ({op}){hint}; grant the credentials in use {permission} on bucket "
            f"{bucket!r}, or use credentials that have it"
        )
    if isinstance(exc, FileNotFoundError) or codes & {"NoSuchKey", "404", "NotFound"}:
        if _bucket_missing(scheme, fs, bucket):
            return _no_bucket(url, fs)
        return StorageNotFoundError(f"{url}: no such object; check the path")
    if names & _NETWORK or isinstance(exc, (ConnectionError, TimeoutError)):
        knob = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
        return StorageNetworkError(
            f"{url}: cannot reach {_endpoint(scheme, fs)} ({text}); check the network (and {knob} if set), then retry"
        )
    return None


@contextlib.contextmanager
def _errors(url: str, op: str, fs: Any = None) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        err = _translate(e, url, op, fs)
        if err is None or err is e:
            raise
        raise err from None


def storage_error(exc: BaseException, path: PathArg, op: str) -> StorageError | None:
    """The one-line StorageError for an exception a storage library raised while it worked on
    `path` (``op``: read, write, list, delete, stat), or None if it is no storage failure. For
    errors from code that calls the clients itself (a checkpoint library) and may wrap them."""
    path = normalize(path)
    fs = _filesystem(_split(path)[0]) if is_remote(path) else None
    for cause in _chain(exc):
        err = _translate(cause, path, op, fs)
        if err is not None:
            return err
    return None
