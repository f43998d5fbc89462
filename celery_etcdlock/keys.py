"""How user-given names map to etcd keys.

Every key this package writes lives under the client's prefix, in one of a
few namespaces. A name is encoded into a single key segment made only of
``[A-Za-z0-9_-]`` and ``~XX`` escapes (the UTF-8 bytes of anything else), so
``"a/b"``, ``".."``, ``"a b"`` and ``"é"`` each get their own key and no
name can climb out of its namespace or collide with another name.

A name whose segment would be longer than ``MAX_SEGMENT`` (a lock named
after a huge task argument, say) keeps a readable head and ends in ``~~``
and the SHA-256 of the whole name: any name still works, and its key stays
small. ``~~`` never occurs in a plain segment (a ``~`` is always followed
by two hex digits), so the two kinds never collide.

    >>> encode_name("reports/daily")
    'reports~2Fdaily'
    >>> decode_name("reports~2Fdaily")
    'reports/daily'
"""

from __future__ import annotations

import functools
import hashlib
import re

LOCKS = "locks"  # Mutex and RWLock queues (a Mutex is the write side of the RWLock of its name)
ELECTIONS = "elections"  # Election queues
SEMAPHORES = "semaphores"  # Semaphore queues
RECORDS = "records"  # JSON documents: beat schedule state, enqueue markers

MAX_SEGMENT = 200  # characters of one encoded name; etcd allows more, but keys are read, listed and logged
_HEAD = 120  # characters of a long name's encoding kept readable before its hash
_HASHED = "~~"

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_ESCAPE = re.compile(r"~([0-9A-F]{2})")


def encode_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("name must be a non-empty string")
    raw = name.encode("utf-8")
    encoded = "".join(chr(b) if b in _SAFE else f"~{b:02X}" for b in raw)
    if len(encoded) <= MAX_SEGMENT:
        return encoded
    head = encoded[:_HEAD]
    if "~" in head[-2:]:  # never cut an escape in two
        head = head[: head.rindex("~")]
    return f"{head}{_HASHED}{hashlib.sha256(raw).hexdigest()}"


def decode_name(segment: str) -> str:
    """The name of ``segment``; a hashed long name reads as its head, then ``...#`` and the start of its hash."""
    head, hashed, digest = segment.partition(_HASHED)
    if hashed:
        return f"{decode_name(head)}...#{digest[:12]}"
    raw = bytearray()
    i = 0
    while i < len(segment):
        match = _ESCAPE.match(segment, i)
        if match:
            raw.append(int(match.group(1), 16))
            i = match.end()
        else:
            raw.extend(segment[i].encode("utf-8"))
            i += 1
    return raw.decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=4096)  # task runs take the same few names again and again
def queue_key(namespace: str, name: str) -> str:
    return f"{namespace}/{encode_name(name)}"


def record_key(kind: str, name: str) -> str:
    return f"{RECORDS}/{encode_name(kind)}/{encode_name(name)}"


def record_prefix(kind: str, name: str) -> str:
    """The prefix of a group of records of one owner (a beat's runtime entries): ``records/<kind>/<name>``.

    Its records are ``record_prefix(kind, name) + "/" + encode_name(member)``; as their kind
    is one segment, no plain record (``record_key``) is ever under such a prefix.
    """
    return f"{RECORDS}/{encode_name(kind)}/{encode_name(name)}"
