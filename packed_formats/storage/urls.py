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
(``/``, ``@``, ``?`` and ``#`` among them: AWS secret keys often hold ``/``), so the ``@`` that
ends the user-info is not always the first one, nor before the first ``/`` or ``?``.

- Shown, the rule hides more, never less: everything between ``://`` and the last ``@`` that a
  host may follow (a run of host characters, then anything but ``&`` or ``=``: an ``@`` in a
  query value such as ``GoogleAccessId=svc@project...&`` is followed by the next parameter) is
  ``***``, wherever that ``@`` is, query and fragment included.  So a shown URL may hide more
  than a secret (``s3://bucket/me@example.com/x`` shows as ``s3://***@example.com/x``, an
  ``abfs://container@account...`` URL hides its container) but never less.
- Sent, the user-info is everything before the last ``@`` that comes before the first ``/``
  following the first ``@``, in the URL before its query or fragment (``s3://user:pa/ss@bucket/key``).
  A URL where that cannot be told apart is refused before any request (a ``RemoteError`` that
  shows no part of it): one where no plain host and path follow that user-info (or the ``://``,
  when there is none: ``s3://key:se?cret@bucket/x``, whose host would be ``key:se``), where
  another ``@`` a host may follow comes after it before the query (``s3://key:se@cr/et@bucket/x``),
  or whose query holds an ``@``, a host and a ``/``.  Credentials then go through the
  environment or ``storage_options``.
- A bucket URL's user-info is left out of the request when it holds a ``:`` (a key and a
  secret) or no ``/`` (a user name), and otherwise kept as part of the key (one that holds
  ``@``); an http(s) URL sends it as credentials to the host after it (``/`` encoded): a path
  holding ``@`` in an http(s) URL is written ``%40``.  Those credentials go in an
``Authorization: Basic`` header of exactly the bytes they percent-decode to (``http_authorization``),
whatever they hold: an HTTP client would decode them as UTF-8 and encode them as Latin-1, and fail
on (or alter) anything else.
"""

from __future__ import annotations

import base64
import os
import re
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import unquote_to_bytes

from ..errors import MissingDependencyError, RemoteError

REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "http", "https", "az", "abfs", "abfss")
HTTP_SCHEMES = ("http", "https")
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# a URL in a text: its scheme, then everything up to the next white space (a secret holds none,
# and quotes, parentheses and commas are legal in a user-info: the URL is taken to run through them)
_URL_IN_TEXT = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]{0,31}://)(\S*)")  # bounded: a long word costs little
# a query (or fragment) parameter whose name says it carries a secret: signatures (AWS SigV4
# X-Amz-Signature and SigV2 Signature, GCS X-Goog-Signature, Azure SAS sig), credentials, tokens,
# keys, passwords; its value runs to the next parameter or white space
_SECRET_WORDS = r"sig|token|key|credential|secret|password|passwd|pwd|auth|accessid|session"
_SECRET_PARAMETER = re.compile(rf"(?i)([?&;#][^=&;#?\s]{{0,64}}(?:{_SECRET_WORDS})[^=&;#?\s]{{0,64}}=)[^&#\s]*")
# the same, percent-encoded (a URL quoted whole inside another's path, as some errors show a key)
_ENCODED_SECRET_PARAMETER = re.compile(rf"(?i)((?:%3F|%26|%3B|%23)[A-Za-z0-9_.~-]{{0,64}}(?:{_SECRET_WORDS})"
                                       rf"[A-Za-z0-9_.~-]{{0,64}}%3D)[^&#\s\"]*")
# an '@' a host may follow: a run of host characters, then the end or anything but '&' and '=' (what
# follows an '@' in a query value is the next parameter), so never an '@' that ends a user-info is missed
_HOST_CHARS = r"-A-Za-z0-9._~%:\[\]"
_USERINFO_END = re.compile(rf"@(?=[{_HOST_CHARS}]*(?:[^{_HOST_CHARS}&=]|$))")
_PLAIN_AUTHORITY = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~%-]+)(?::[0-9]+)?")  # a host and port
_HOST_AND_PATH_AFTER_AT = re.compile(rf"@[{_HOST_CHARS}]+/")  # in a query: an '@' that could end a user-info
INSTALL_HINT = "pip install '.[remote]' in packed_formats' folder (fsspec with s3fs, gcsfs and aiohttp)"


def is_remote(path: Any) -> bool:
    """Whether ``path`` names an object in a store (a URL with a remote scheme), not a local file."""
    if not isinstance(path, str):
        return False
    match = _URL.match(path)
    return match is not None and match.group(1).lower() in REMOTE_SCHEMES


def _userinfo_end(rest: str) -> int:
    """Where the shown user-info of ``rest`` (a URL after its ``://``) ends: the index of the last
    ``@`` a host may follow, or -1 for none (the rule in the module's notes: it hides more, never less)."""
    ends = [m.start() for m in _USERINFO_END.finditer(rest)]
    return ends[-1] if ends else -1


def _request_userinfo_end(scheme: str, rest: str) -> int:
    """Where the user-info of ``rest`` ends for a request: the index of its ``@``, or -1 for none;
    RemoteError when that cannot be told (the rule in the module's notes)."""
    if _userinfo_end(rest) < 0:
        return -1
    head, tail = _split_query(rest)
    first = head.find("@")
    end = -1
    if first >= 0:
        slash = head.find("/", first)
        end = head.rfind("@", 0, len(head) if slash < 0 else slash)
    host = head[end + 1:].split("/", 1)[0]
    port_ok = scheme in HTTP_SCHEMES or ":" not in host  # a bucket's name holds no ':'
    if not _PLAIN_AUTHORITY.fullmatch(host) or not port_ok or "/" not in head[end + 1:] or \
            _USERINFO_END.search(head, end + 1) or _HOST_AND_PATH_AFTER_AT.search(tail):
        raise _ambiguous(scheme)  # no host or no path after it, or another '@' a host and path may follow
    return end


def _ambiguous(scheme: str) -> RemoteError:
    return RemoteError(
        f"{scheme}://***", "the URL's user name and password cannot be told apart from its host and key (they "
        "hold an '@' before a '/', or a '?' or '#'), so it is not used; no part of it is shown",
        hint="pass credentials through the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile) "
             "or storage_options, not in the URL")


def _hide(rest: str) -> str:
    """``rest`` (a URL after its ``://``) with its user-info and secret parameters replaced by ``***``."""
    # the user-info, the secret values of the query (found in the URL as given: a value that holds the
    # '@' the user-info ends at is hidden whole) and those after the user-info, then joined
    userinfo = _userinfo_end(rest)
    base = max(userinfo, 0)
    opened = re.search(r"[?#]", rest)
    starts = len(rest) if opened is None else opened.start()  # where the query (or fragment) starts
    query = [(m.end(1), m.end()) for m in _SECRET_PARAMETER.finditer(rest) if m.start() >= starts]
    after = [(base + m.end(1), base + m.end()) for m in _SECRET_PARAMETER.finditer(rest[base:])]
    merged: List[List[int]] = []
    for start, stop in sorted([(0, userinfo)] + query + after):
        if stop < start:  # no user-info
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    shown, at = [], 0
    for start, stop in merged:
        shown += [rest[at:start], "***"]
        at = stop
    return "".join(shown) + rest[at:]


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
    end = _request_userinfo_end(scheme, rest)
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
    end = _request_userinfo_end(match.group(1).lower(), rest)
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

