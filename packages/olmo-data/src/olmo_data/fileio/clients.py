"""The fsspec clients of ``gs://`` (gcsfs) and ``s3://`` (s3fs): one per process and
environment, so a changed credential or endpoint variable (a test that unsets the credentials,
a fork) gets a new one."""

from __future__ import annotations

import os
import threading
from typing import Any

from .errors import StorageError
from .names import PathArg, _split, is_remote, normalize

# Ranged GETs one `staged_reads` (one batch of a loader thread) keeps in flight at most: enough
# to cover a rank's windows of a batch in one or two round trips, few enough not to swamp a
# store or a small host's event loop with connections.
DEFAULT_CONCURRENT_READS = 32
# HTTP connections a client keeps open to its endpoint (S3; gcsfs's aiohttp allows 100):
# two loader threads' worth of DEFAULT_CONCURRENT_READS.
MAX_CONNECTIONS = 2 * DEFAULT_CONCURRENT_READS


# The variables the cloud clients read. A client is cached per value of all of them, so a
# changed credential, endpoint or retry setting takes effect on the next call.
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "CLOUDSDK_", "GCE_", "STORAGE_EMULATOR_HOST", "NO_GCE_CHECK")
_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()
_EXTRAS = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs")}


def _filesystem(scheme: str) -> Any:
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    # The pid: a forked child must not reuse its parent's HTTP sessions.
    key = (scheme, os.getpid(), env)
    with _clients_lock:
        fs = _clients.get(key)
        if fs is not None:
            return fs
        module, extra = _EXTRAS[scheme]
        try:
            if scheme == "s3":
                import s3fs

                # botocore's connection pool holds 10 by default: fewer than the ranged GETs
                # `staged_reads` keeps in flight for two loader threads.
                fs = s3fs.S3FileSystem(
                    skip_instance_cache=True,
                    use_listings_cache=False,
                    config_kwargs={"max_pool_connections": MAX_CONNECTIONS},
                )
            else:
                import gcsfs
                import gcsfs.core

                if os.environ.get("STORAGE_EMULATOR_HOST"):
                    # The plain client, anonymous: gcsfs's default class asks the storage-control
                    # API for each bucket's layout, which no emulator serves.
                    fs = gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True, use_listings_cache=False)
                else:
                    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, use_listings_cache=False)
        except ImportError:
            raise StorageError(
                f"{scheme}:// paths need {module}; install the olmo-data extra: pip install 'olmo-data[{extra}]' "
                f"(uv sync --extra {extra})"
            ) from None
        # Clients of an older environment or process are dropped: at most one is live per scheme.
        for old in [k for k in _clients if k[0] == scheme]:
            del _clients[old]
        _clients[key] = fs
        return fs


def filesystem(url: PathArg) -> tuple[Any, str]:
    """(fsspec filesystem, "bucket/key") for a gs:// or s3:// URL: the same client, endpoint and
    credentials as every other call here (with ``STORAGE_EMULATOR_HOST`` the plain anonymous
    GCS client), for a library that takes an fsspec filesystem."""
    url = normalize(url)
    if not is_remote(url):
        raise StorageError(f"filesystem({url}): not a gs:// or s3:// URL")
    scheme, key = _split(url)
    return _filesystem(scheme), key
