"""What the store libraries log, without the credentials in it.

At DEBUG, fsspec, botocore, aiohttp and urllib3 (and the others below) log each request: its URL (a
presigned URL's signature, an http(s) URL's user name and password), its headers (``Authorization``,
``X-Amz-Security-Token``) and, botocore, the canonical request and the signature it computed.  Once a
``Store`` is made (``storage.remote`` calls ``hide_secrets_in_logs`` when it is imported), every log record
of those libraries' loggers is redacted as it is made, before any handler, filter or queue sees it:
its message is formatted and redacted (``redact_log``), and so are its traceback and stack.

A record factory, not a logging filter: a filter on a logger sees only the records logged to that
logger itself, not those of its children (``botocore.auth``), nor those of loggers made later.  The one
way around it is a record factory set later that does not call the one it replaces.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

from .urls import _SECRET_WORDS, redact

# the top-level loggers of the libraries that reach stores for us (and of those they use)
STORE_LIBRARIES = frozenset({"fsspec", "s3fs", "gcsfs", "adlfs", "botocore", "aiobotocore", "boto3", "urllib3",
                             "aiohttp", "google", "azure", "requests"})
# a header, field or parameter name (bounded, so a long run of letters costs little); it holds a secret when
# it says so (_SECRET), which a replacement asks of the name it found (no alternation inside the pattern)
_NAME = r"[\w-]{1,64}"
_SECRET = re.compile(rf"(?i){_SECRET_WORDS}")
_REDACTIONS = [
    # a quoted field of a printed dict or headers: 'X-Amz-Security-Token': b'...', "Authorization": '...'
    (re.compile(rf"(['\"]{_NAME}['\"]\s*:\s*b?)(['\"])(?:\\.|(?!\2)[^\\\n])*\2"), r"\1\2***\2"),
    # a header or label alone on its line, its value after it or on the next line (a canonical request's
    # "x-amz-security-token:...", botocore's "Signature:\n<hex>")
    (re.compile(rf"(?m)^({_NAME}:)[ \t]*\n[^\n]*"), "\\1\n***"),
    (re.compile(rf"(?m)^({_NAME}:)[ \t]*[^\s].*$"), r"\1***"),
    # name=value in a header's text: "Credential=AKIA.../..., SignedHeaders=..., Signature=<hex>"
    (re.compile(rf"\b({_NAME}=)[^\s,&'\"]*"), r"\1***"),
    # name: value within a line ("Authorization: Basic dXNlcjpwYXNz")
    (re.compile(r"(?i)\b((?:proxy-)?authorization:[ \t]*)[^\n'\"]*"), r"\1***"),
]
_lock = threading.Lock()
_installed = False


def redact_log(text: str) -> str:
    """``text`` (a store library's log message, traceback or stack) with the credentials it may hold
    replaced by ``***``: those of URLs (``urls.redact``) and the values of headers, fields and parameters
    whose names say they hold a secret (authorization, signature, token, credential, key, password...)."""
    text = redact(text)
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(functools.partial(_hidden_if_secret, replacement), text)
    return text


def _hidden_if_secret(replacement: str, match: "re.Match[str]") -> str:
    """``match`` replaced when the name it found (its first group) says it holds a secret, else as it is."""
    return match.expand(replacement) if _SECRET.search(match.group(1)) else match.group(0)


def _redacted(record: logging.LogRecord) -> logging.LogRecord:
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a message that cannot be formatted: what it holds, as text
        message = f"{record.msg} {record.args}"
    record.msg, record.args = redact_log(message), ()
    if record.exc_info and not record.exc_text:
        record.exc_text = redact_log(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact_log(record.stack_info)
    return record


def hide_secrets_in_logs() -> None:
    """From now on, in this process, redact every log record of the store libraries' loggers as it is
    made (a record factory that calls the one it replaces).  Calling it again does nothing."""
    global _installed
    with _lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def make_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            if str(record.name).split(".", 1)[0] in STORE_LIBRARIES:
                return _redacted(record)
            return record

        logging.setLogRecordFactory(make_record)
        _installed = True
