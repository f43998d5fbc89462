"""The endpoints of one cluster, as a backend uses them: one pool each, the current one, fail-over.

Both HTTP backends (v2's keys API, v3's gateway) send every request to the
endpoint they use now, and move to the next one when it fails; what counts
as a failure, and where to go next, is decided here once for both:

    endpoints = Endpoints(parse_url("etcd3://h1:2379,h2:2379"))   # no I/O yet
    index, pool = endpoints.pick()                                 # the current endpoint and its pool
    try:
        response = pool.request("POST", "/v3/kv/range", body, timeout=5)
    except OSError as exc:
        raise endpoints.connection_failure(index, exc) from None  # Transient (moved on), or the reason
    with endpoints.watching(index, response): ...                  # ended at once if the client moves on
    answer = endpoints.decoded(index, lambda: int(json.loads(response.body)["header"]["revision"]))

- ``rotate(index)``: endpoint ``index`` failed; the next one becomes current
  (once, however many requests saw it fail), and the watches open on it end.
- ``connection_failure``: a TLS certificate that fails verification, or a
  server that refuses our client certificate, is an answer (the same next
  time): a ``BackendError`` with the reason, at once. Anything else the
  socket raises is ``retry.Transient``, after a move to the next endpoint.
- ``malformed`` / ``decoded``: an answer this client cannot read (not JSON,
  wrong types, missing fields, too deep, too large) is a ``BackendError``
  naming the endpoint; with more endpoints, it is ``retry.Transient`` after a
  move, so that another member answers.
- ``after_fork()`` drops the parent's connections unclosed; ``close()``
  closes them.

Thread-safe. ``native=True``: for a native thread in a gevent process (a
session's renewer), with connections on the OS's own sockets and OS locks.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from .. import green
from ..errors import BackendError
from ..options import ConnectionOptions
from . import retry, transport
from .transport import Pool, Response

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: what reading an answer of the wrong shape raises: a missing field, a wrong type, a bad number, nesting too deep
UNREADABLE = (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError)


class Endpoints:
    """The endpoints of one ``ConnectionOptions``: a connection pool each (made on first use) and the current one."""

    def __init__(self, options: ConnectionOptions, *, native: bool = False) -> None:
        self.options = options
        self.urls = options.endpoint_urls  # what errors and logs name
        self.native = native
        self.current = 0  # the endpoint requests go to
        self.new_lock = green.native_lock if native else threading.Lock
        self._lock = self.new_lock()
        self._pools: list[Pool | None] = [None] * len(self.urls)
        self._watches = OpenWatches()

    def pick(self) -> tuple[int, Pool]:
        """The current endpoint and its pool."""
        with self._lock:
            index = self.current
            return index, self._pool(index)

    def pool(self, index: int) -> Pool:
        with self._lock:
            return self._pool(index)

    def _pool(self, index: int) -> Pool:
        pool = self._pools[index]
        if pool is None:
            pool = self._pools[index] = transport.endpoint_pool(self.options, index, native_sockets=self.native)
        return pool

    def rotate(self, failed: int) -> None:
        """Endpoint ``failed`` failed: move to the next one (if it is still current), and end its watches."""
        with self._lock:
            if self.current != failed or len(self.urls) == 1:
                return
            self.current = (failed + 1) % len(self.urls)
            logger.warning("etcd %s failed; switching to %s", self.urls[failed], self.urls[self.current])
        self._watches.leave(failed)

    def reset(self, index: int) -> None:
        """Close endpoint ``index``'s connections: the next request connects afresh (a replaced server)."""
        with self._lock:
            pool, self._pools[index] = self._pools[index], None
        if pool is not None:
            pool.close()

    def watching(self, index: int, response: Response) -> contextlib.AbstractContextManager[None]:
        """Track ``response``, a watch being read from endpoint ``index``: a move to another endpoint ends it."""
        return self._watches.watching(index, response, lambda: self.current)

    # -- what a failure means -------------------------------------------------

    def connection_failure(self, index: int, exc: OSError) -> Exception:
        """What ``exc``, raised by a request to endpoint ``index``, means (returned, not raised)."""
        refusal = tls_refusal(self.urls[index], exc)
        if refusal is not None:
            return refusal
        if isinstance(exc, transport.ProtocolError) and not isinstance(exc, transport.NotHTTP):
            return self.malformed(index, exc)
        self.rotate(index)
        return retry.Transient(self.urls[index], exc)

    def malformed(self, index: int, exc: BaseException | str) -> Exception:
        """An answer from endpoint ``index`` this client cannot read: fail over if another may answer."""
        endpoint = self.urls[index]
        why = exc if isinstance(exc, str) else f"{type(exc).__name__}: {str(exc)[:120]}"
        message = f"etcd at {endpoint} sent an answer this client cannot read ({why})"
        if len(self.urls) > 1:
            self.rotate(index)
            return retry.Transient(endpoint, message)
        return BackendError(message)

    def decoded(self, index: int, read: Callable[[], T]) -> T:
        """``read()``, which decodes an answer from endpoint ``index``; one of the wrong shape is ``malformed``."""
        try:
            return read()
        except UNREADABLE as exc:
            raise self.malformed(index, exc) from None

    def guarded(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn``, an operation on answers from the current endpoint, with answers of the wrong shape ``malformed``."""

        def run() -> T:
            index = self.current  # the endpoint the answers come from: a move in between comes only with a failure
            return self.decoded(index, fn)

        return run

    # -- process life ---------------------------------------------------------

    def after_fork(self) -> None:
        """Drop the parent's pools unclosed: their sockets (and TLS state) are the parent's."""
        self._lock = self.new_lock()
        self._pools = [None] * len(self.urls)
        self._watches = OpenWatches()

    def close(self) -> None:
        with self._lock:
            pools, self._pools = self._pools, [None] * len(self.urls)
        for pool in pools:
            if pool is not None:
                pool.close()


def tls_refusal(endpoint: str, exc: OSError) -> BackendError | None:
    """The error for a TLS handshake that failed for good (a certificate not trusted, either way), or None."""
    if not isinstance(exc, ssl.SSLError):
        return None
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        return BackendError(
            f"the TLS certificate of {endpoint} could not be verified: {exc} "
            "(give the CA that signed it with ?ca=/path/to/ca.pem)"
        )
    if any(alert in text for alert in ("ALERT_BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "UNKNOWN_CA")):
        return BackendError(
            f"{endpoint} refused the TLS connection ({exc}): it wants a client certificate it trusts "
            "(give ?cert=/path/to/client.pem&key=/path/to/client.key)"
        )
    return None


class OpenWatches:
    """The watches a client has open on each endpoint, so that leaving an endpoint ends them there at once.

    A watch on a member cut off from the others, or frozen, never fires: it would wait for its
    own timeout (twice the TTL) after the client's other requests, its renewals, had moved to a
    healthy member, and a waiter at the head of a queue would hold up everyone behind it. Ending
    the watch makes its read fail at once; the backend's retry policy watches again, on the
    endpoint the client uses now, from the same revision, so no event is missed.
    """

    def __init__(self) -> None:
        self._lock = green.native_lock()  # the renewer thread may leave an endpoint while a greenlet watches
        self._open: dict[int, tuple[int, Response]] = {}  # id(response) -> (endpoint index, response)

    @contextlib.contextmanager
    def watching(self, index: int, response: Response, current: Callable[[], int]) -> Iterator[None]:
        """Track ``response``, a watch's answer being read from endpoint ``index``, while the block runs.

        ``current()`` is the endpoint the client uses now: if it already moved on, the watch ends at once.
        """
        with self._lock:
            self._open[id(response)] = (index, response)
        try:
            if current() != index:  # after registering: a move from now on finds it, one before is seen here
                response.abort()
            yield
        finally:
            with self._lock:
                self._open.pop(id(response), None)

    def leave(self, index: int) -> None:
        """End every watch open on endpoint ``index``: the client moved to another endpoint."""
        with self._lock:
            responses = [response for at, response in self._open.values() if at == index]
        for response in responses:
            response.abort()
