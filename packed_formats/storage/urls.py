"""The one place that tells a URL from a local path, and keeps credentials out of what we print.

A remote archive is named by a URL with a scheme fsspec knows (``s3://bucket/train.zip``,
``gs://...``, ``https://...``).  Two forms of one URL exist:

- what is shown (``clean_url``, ``redact``): the URL without its user name and password and
  with the values of signed or token query parameters replaced by ``***``; this is what goes
  in a message, a log, an archive, a cache record, a resume state or an error;
- what is sent (``request_url``): the URL as given, with its query string (a presigned URL's
  signature) and, for http(s), its user name and password, which the server checks.  Bucket
  stores (s3, gs, az) take credentials from their usual configuration (the environment,
  profile files, instance roles, ``storage_options``), never from a URL: a user name and
  password in such a URL are left out of the request.

``RemoteURL`` carries both: its text is the shown URL, its ``request`` the one to send.

Where the user-info ends.  A secret pasted raw into a URL may hold any character a URL may
(``/`` among them: AWS secret keys often do), so the ``@`` that ends the user-info is not
always the first one: in ``s3://user:pa/ss@bucket/key`` it follows a ``/``.  The rule, which
errs on the side of hiding: in the URL before its query (``?``) or fragment (``#``), if an
``@`` occurs, the user-info is everything between ``://`` and the last ``@`` before the first
``/`` that follows the first ``@`` (or before the end, when no ``/`` follows).  So a shown
URL may hide more than a secret (``s3://bucket/me@example.com/x`` shows as
``s3://***@example.com/x``, an ``abfs://container@account...`` URL hides its container) but
never less.  For a request, a bucket URL's user-info is left out when it holds a ``:`` (a key
and a secret) or no ``/`` (a user name), and otherwise kept as part of the key (one that
holds ``@``); an http(s) URL sends it as credentials to the host after it (``/`` encoded): a
path holding ``@`` in an http(s) URL is written ``%40``.  Those credentials go in an
``Authorization: Basic`` header of exactly the bytes they percent-decode to (``http_authorization``),
whatever they hold: an HTTP client would decode them as UTF-8 and encode them as Latin-1, and fail
on (or alter) anything else.
"""

from __future__ import annotations

import base64
import os
import re
from typing import Any, Dict, Optional, Tuple
from urllib.parse import unquote_to_bytes

from ..errors import MissingDependencyError

REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "http", "https", "az", "abfs", "abfss")
HTTP_SCHEMES = ("http", "https")
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# a URL in a text: its scheme, then everything up to the next white space (a secret holds none,
# and quotes, parentheses and commas are legal in a user-info: the URL is taken to run through them)
_URL_IN_TEXT = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)(\S*)")
# a query (or fragment) parameter whose name says it carries a secret: signatures (AWS SigV4
# X-Amz-Signature and SigV2 Signature, GCS X-Goog-Signature, Azure SAS sig), credentials, tokens,
# keys, passwords; its value runs to the next parameter or white space
_SECRET_WORDS = r"sig|token|key|credential|secret|password|passwd|pwd|auth|accessid|session"
_SECRET_PARAMETER = re.compile(rf"(?i)([?&;#][^=&;#?\s]*(?:{_SECRET_WORDS})[^=&;#?\s]*=)[^&#\s]*")
# the same, percent-encoded (a URL quoted whole inside another's path, as some errors show a key)
_ENCODED_SECRET_PARAMETER = re.compile(rf"(?i)((?:%3F|%26|%3B|%23)[A-Za-z0-9_.~-]*(?:{_SECRET_WORDS})"
                                       rf"[A-Za-z0-9_.~-]*%3D)[^&#\s\"]*")
INSTALL_HINT = "pip install '.[remote]' in packed_formats' folder (fsspec with s3fs, gcsfs and aiohttp)"


def is_remote(path: Any) -> bool:
    """Whether ``path`` names an object in a store (a URL with a remote scheme), not a local file."""
    if not isinstance(path, str):
        return False
    match = _URL.match(path)
    return match is not None and match.group(1).lower() in REMOTE_SCHEMES


def _userinfo_end(rest: str) -> int:
    """Where the user-info of ``rest`` (a URL after its ``://``) ends: the index of its ``@``, or -1
    for none (the rule in the module's notes)."""
    head = re.split(r"[?#]", rest, maxsplit=1)[0]
    first = head.find("@")
    if first < 0:
        return -1
    slash = head.find("/", first)
    return head.rfind("@", 0, len(head) if slash < 0 else slash)


def _hide(rest: str) -> str:
    """``rest`` (a URL after its ``://``) with its user-info and secret parameters replaced by ``***``."""
    end = _userinfo_end(rest)
    if end >= 0:
        rest = "***" + rest[end:]
    return _SECRET_PARAMETER.sub(r"\1***", rest)


def redact(text: str) -> str:
    """``text`` with every URL's user name, password and signed or token query parameters replaced by ``***``."""
    text = _URL_IN_TEXT.sub(lambda m: m.group(1) + _hide(m.group(2)), str(text))
    return _ENCODED_SECRET_PARAMETER.sub(r"\1***", _SECRET_PARAMETER.sub(r"\1***", text))


def clean_url(url: str) -> str:
    """``url`` as shown: without credentials in it (see ``redact``); the scheme is lower-cased.
    ValueError (without the URL's secrets) if ``url`` is not a URL."""
    match = _URL.match(url)
    if match is None:
        raise ValueError(f"not a URL: {redact(url)!r}")
    return f"{match.group(1).lower()}://{_hide(url[match.end():])}"


def request_url(url: str) -> str:
    """``url`` as sent to the store: its query string kept (a presigned URL's signature) and, for
    http(s), its user-info (credentials for the server, a ``/`` in them encoded as ``%2F``); a
    bucket store's credentials left out (see the module's notes); the scheme lower-cased.  A
    ``RemoteURL`` gives the URL it was made from."""
    if isinstance(url, RemoteURL):
        return url.request
    match = _URL.match(url)
    if match is None:
        raise ValueError(f"not a URL: {redact(url)!r}")
    scheme, rest = match.group(1).lower(), url[match.end():]
    end = _userinfo_end(rest)
    if scheme in HTTP_SCHEMES:
        return f"{scheme}://{rest}" if end < 0 else f"{scheme}://{rest[:end].replace('/', '%2F')}{rest[end:]}"
    rest = _without_secret_parameters(rest)  # a bucket store signs its own requests: its key never holds them
    if end < 0:
        return f"{scheme}://{rest}"
    userinfo = rest[:end]
    if ":" not in userinfo and ("/" in userinfo or scheme in ("az", "abfs", "abfss")):
        return f"{scheme}://{rest}"  # a key that holds '@', or a container@account
    return f"{scheme}://{rest[end + 1:]}"  # credentials, or a user name: the store reads its own


def http_authorization(request: str) -> Tuple[str, Optional[str]]:
    """(``request`` without its user-info, the ``Authorization`` header value for it) for an http(s)
    request URL (``request_url``'s): ``Basic`` and the base64 of the user name and password as the
    bytes their ``%XX`` escapes stand for, joined by ``:``; (``request``, None) for a URL without
    user-info or of another scheme."""
    match = _URL.match(request)
    if match is None or match.group(1).lower() not in HTTP_SCHEMES:
        return request, None
    rest = request[match.end():]
    end = _userinfo_end(rest)
    if end < 0:
        return request, None
    user, _, password = rest[:end].partition(":")
    credentials = unquote_to_bytes(user) + b":" + unquote_to_bytes(password)
    return f"{match.group(1).lower()}://{rest[end + 1:]}", "Basic " + base64.b64encode(credentials).decode("ascii")


def _without_secret_parameters(rest: str) -> str:
    base, query = _split_query(rest)
    if not query.startswith("?"):
        return rest
    kept = [p for p in query[1:].split("&") if not _SECRET_PARAMETER.match("?" + p)]
    return base + ("?" + "&".join(kept) if kept else "")


class RemoteURL(str):
    """A URL whose text is what is shown (``clean_url``) and whose ``request`` is what is sent
    (``request_url``): printed, formatted, compared or written as JSON it is the shown URL;
    ``Store`` sends its ``request``.  It pickles with both (a DataLoader worker reads with it)."""

    request: str

    def __new__(cls, url: str) -> "RemoteURL":
        if isinstance(url, RemoteURL):
            return url
        return cls._of(clean_url(url), request_url(url))

    @classmethod
    def _of(cls, shown: str, request: str) -> "RemoteURL":
        made = super().__new__(cls, shown)
        made.request = request
        return made

    def __reduce__(self) -> Tuple[Any, Tuple[str, str]]:
        return _restore, (str(self), self.request)

    def __repr__(self) -> str:
        return repr(str(self))


def _restore(shown: str, request: str) -> RemoteURL:
    return RemoteURL._of(shown, request)


def _split_query(url: str) -> Tuple[str, str]:
    """(the URL before its query or fragment, the query with its ``?`` or ``''``)."""
    match = re.search(r"[?#]", url)
    return (url, "") if match is None else (url[:match.start()], url[match.start():])


def _join_one(url: str, name: str, keep_query: bool) -> str:
    base, query = _split_query(url)
    return f"{base.rsplit('/', 1)[0]}/{name}" + (query if keep_query and query.startswith("?") else "")


def join(url: str, name: str) -> str:
    """The URL of ``name`` beside the object at ``url`` (in the same "directory").

    A ``RemoteURL`` gives a ``RemoteURL`` that keeps its query string (a token valid for the
    store's folder, such as an Azure SAS, reaches the set's other objects with it)."""
    if isinstance(url, RemoteURL):
        return RemoteURL._of(_join_one(str(url), name, True), _join_one(url.request, name, True))
    return _join_one(url, name, False)


def basename(url: str) -> str:
    """The object's name: the URL's last path component (query string and fragment left out)."""
    return _split_query(str(url))[0].rstrip("/").rsplit("/", 1)[-1]


def filesystem(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[Any, str]:
    """(fsspec file system, path in it) for ``url`` (the URL requests go to: ``request_url``);
    MissingDependencyError naming the extra to install when fsspec or the protocol's package is missing.

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
        raise MissingDependencyError(clean_url(url), f"no fsspec support for {scheme}:// ({redact(str(exc))})",
                                     hint=INSTALL_HINT) from None
    except ValueError as exc:
        raise MissingDependencyError(clean_url(url), redact(str(exc)), hint=INSTALL_HINT) from None
    return fs, path

