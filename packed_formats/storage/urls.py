"""The one place that tells a URL from a local path, and keeps credentials out of what we print.

A remote archive is named by a URL with a scheme fsspec knows (``s3://bucket/train.zip``,
``gs://...``, ``https://...``).  Credentials come from each protocol's usual configuration (the
environment, profile files, instance roles), never from the URL we print: ``redact`` removes a
user name and password and signed query parameters from any URL or message before it is
shown, logged, written to an archive, a resume state or an error.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, Optional, Tuple

from ..errors import MissingDependencyError

REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "http", "https", "az", "abfs", "abfss")
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# userinfo in any URL of a text, and query parameters that carry a signature or a token
_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_SECRET_PARAMETER = re.compile(
    r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig|token|access_token|"
    r"awsaccesskeyid|x-goog-signature|x-goog-credential|key)=)[^&\s'\"]*"
)
INSTALL_HINT = "pip install 'packed_formats[remote]' (fsspec with s3fs, gcsfs and aiohttp)"


def is_remote(path: Any) -> bool:
    """Whether ``path`` names an object in a store (a URL with a remote scheme), not a local file."""
    if not isinstance(path, str):
        return False
    match = _URL.match(path)
    return match is not None and match.group(1).lower() in REMOTE_SCHEMES


def redact(text: str) -> str:
    """``text`` with every URL's user name, password and signed query parameters replaced by ``***``."""
    text = _USERINFO.sub(r"\1***@", text)
    return _SECRET_PARAMETER.sub(r"\1***", text)


def clean_url(url: str) -> str:
    """``url`` without credentials in it (what is kept and shown); the scheme is lower-cased."""
    match = _URL.match(url)
    if match is None:
        raise ValueError(f"not a URL: {redact(url)!r}")
    scheme, rest = match.group(1).lower(), url[match.end():]
    rest = re.sub(r"^[^/@]+@", "", rest)  # user:password@host
    return _SECRET_PARAMETER.sub(r"\1***", f"{scheme}://{rest}") if "?" in rest else f"{scheme}://{rest}"


def join(url: str, name: str) -> str:
    """The URL of ``name`` beside the object at ``url`` (in the same "directory")."""
    return f"{url.rsplit('/', 1)[0]}/{name}"


def basename(url: str) -> str:
    """The object's name: the URL's last path component (query string left out)."""
    return url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def filesystem(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[Any, str]:
    """(fsspec file system, path in it) for ``url``; MissingDependencyError naming the extra to
    install when fsspec or the protocol's package is missing.

    ``storage_options`` go to the file system (for example ``{"endpoint_url": ...}`` for an
    S3-compatible store); without them each protocol reads its usual configuration, and an S3
    endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``.
    """
    try:
        import fsspec
    except ImportError:
        raise MissingDependencyError(clean_url(url), "reading from object storage needs fsspec",
                                     hint=INSTALL_HINT) from None
    options = dict(storage_options or {})
    scheme = _URL.match(url).group(1).lower() if _URL.match(url) else ""  # type: ignore[union-attr]
    if scheme in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in options and "client_kwargs" not in options:
            options["endpoint_url"] = endpoint
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise MissingDependencyError(clean_url(url), f"no fsspec support for {scheme}:// ({exc})",
                                     hint=INSTALL_HINT) from None
    except ValueError as exc:
        raise MissingDependencyError(clean_url(url), redact(str(exc)), hint=INSTALL_HINT) from None
    return fs, path
