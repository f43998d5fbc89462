"""The locks under test, as a worker process uses them: ours, the peers and the raw floors.

    impl = make_impl("ours-v3", ports, ttl=10)     # connected; no lock taken yet
    handle = impl.lock("some-name")                # a fresh object with acquire() / release()
    handle.acquire(); handle.release()
    impl.close()

Every kind runs on one server (``LockKind.server``): etcd 3.4 with v2 ("v2"),
etcd 3.5 ("v3"), the v3 API of another release line ("v3-3.4", served by the v2
server; "v3-3.6", "v3-3.7", started on ``--also-v3``) or Redis ("redis"), and that
server's counters measure it. A
floor is not a lock but the cheapest correct "create if absent + delete" on its
server, the yardstick the others are divided by:

- v2: python-etcd ``write(key, prevExist=False)`` + ``delete``;
- v3: etcd3gw ``create`` (one put-if-absent transaction on the JSON gateway) + ``delete``;
- redis: ``SET NX EX`` + ``DEL``.

The peers run with our TTL and otherwise their own defaults (bench/README.md
lists how each is configured).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import common

HOST = common.HOST
OURS_PREFIX = "/etcdlock-bench"


#: the v3 servers beside etcd 3.5's ("v3"): 3.4's is the v2 server (it serves both APIs), 3.6's and
#: 3.7's run when ``--also-v3`` asks for them
OTHER_V3_LINES = ("3.4", "3.6", "3.7")


@dataclass(frozen=True)
class LockKind:
    key: str  # id used on the command line and in the JSON
    label: str  # what the tables call it
    server: str  # "v2", "v3", "v3-<line>" (v3 on etcd <line>) or "redis": where it runs (and whose counters measure it)
    ours: bool = False
    floor: bool = False  # a raw create + delete, not a lock: only for the uncontended floor


KINDS = {
    k.key: k
    for k in (
        LockKind("floor-v2", "raw python-etcd create+delete", "v2", floor=True),
        LockKind("ours-v2", "celery_etcdlock etcd://", "v2", ours=True),
        LockKind("etcd.Lock", "python-etcd etcd.Lock", "v2"),
        LockKind("floor-v3", "raw etcd3gw create+delete", "v3", floor=True),
        LockKind("ours-v3", "celery_etcdlock etcd3://", "v3", ours=True),
        LockKind("tooz-etcd3gw", "tooz etcd3gw lock", "v3"),
        # the v3 floor, ours and tooz on the other release lines: uncontended and contention only
        *(
            kind
            for line in OTHER_V3_LINES
            for kind in (
                LockKind(f"floor-v3-{line}", f"raw etcd3gw create+delete on etcd {line}", f"v3-{line}", floor=True),
                LockKind(f"ours-v3-{line}", f"celery_etcdlock etcd3:// on etcd {line}", f"v3-{line}", ours=True),
                LockKind(f"tooz-etcd3gw-{line}", f"tooz etcd3gw lock on etcd {line}", f"v3-{line}"),
            )
        ),
        LockKind("floor-redis", "raw redis SET NX + DEL", "redis", floor=True),
        LockKind("redis-lock", "python-redis-lock", "redis"),
    )
}
FLOOR_OF = {
    "v2": "floor-v2",
    "v3": "floor-v3",
    **{f"v3-{line}": f"floor-v3-{line}" for line in OTHER_V3_LINES},
    "redis": "floor-redis",
}
LABELS = {**{k: v.label for k, v in KINDS.items()}, "tooz-redis": "tooz redis election"}


def connect_ours(api: str, ports: dict[str, int]) -> Any:
    """A celery_etcdlock client on the benchmark's etcd for ``api`` ("v2" or "v3")."""
    from celery_etcdlock import connect

    scheme = "etcd" if api == "v2" else "etcd3"  # "v3" and "v3-<line>"
    return connect(f"{scheme}://{HOST}:{ports[api]}?prefix={OURS_PREFIX}")


def ours_available(api: str) -> str | None:
    """None if celery_etcdlock's Mutex works on ``api`` in this checkout, else why not."""
    try:
        import celery_etcdlock

        for name in ("Mutex", "RWLock", "Election"):
            getattr(celery_etcdlock, name)
        if api == "v2":
            import celery_etcdlock.etcd.etcd2  # noqa: F401
        else:
            import celery_etcdlock.etcd.etcd3  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any reason is reported, not raised
        return f"{type(exc).__name__}: {exc}"
    return None


class Impl:
    """One lock implementation, connected; ``lock(name)`` gives a fresh object with acquire()/release()."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        self.kind = kind
        self.ports = ports
        self.ttl = ttl
        self.port = ports[KINDS[kind].server]

    def lock(self, name: str) -> Any:
        raise NotImplementedError

    def on_renewal(self, handle: Any, callback: Callable[[], None]) -> bool:
        """Call ``callback`` after each renewal of ``handle``'s hold; False if this lock never renews."""
        return False

    def close(self) -> None:
        pass


def warm_up(impl: Impl) -> None:
    """One acquire+release on a private name: connections, sessions and leases exist afterwards."""
    handle = impl.lock(f"warmup-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    handle.acquire()
    handle.release()


def _text(body: Any) -> str:
    if body is None:
        return ""
    if isinstance(body, bytes):
        return body.decode("latin-1")
    return str(body)


def call_on_http_request(predicate: Callable[[str, str, str], bool], callback: Callable[[], None]) -> None:
    """Call ``callback`` after each HTTP request of this process for which ``predicate(method, url, body)``."""

    def hook(method: str, url: str, body: Any) -> None:
        if predicate(method, url, _text(body)):
            callback()

    common.add_request_hook(hook)


def is_ours_renewal(api: str) -> Callable[[str, str, str], bool]:
    """Whether an HTTP request is one of our sessions' renewals on ``api``."""
    if api == "v2":  # the session refreshes each entry: PUT ...?refresh=true (wakes no watcher)
        return lambda method, url, body: method == "PUT" and "refresh=true" in (url + "&" + body).lower()
    return lambda method, url, body: "/lease/keepalive" in url


class OursMutex(Impl):
    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        self.client = connect_ours(KINDS[kind].server, ports)

    def lock(self, name: str) -> Any:
        from celery_etcdlock import Mutex

        return Mutex(self.client, name, ttl=self.ttl)

    def on_renewal(self, handle: Any, callback: Callable[[], None]) -> bool:
        call_on_http_request(is_ours_renewal(self.client.api), callback)
        return True

    def close(self) -> None:
        self.client.close()


class EtcdLock(Impl):
    """python-etcd's own recipe; lock_ttl = our ttl (it never renews it)."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import etcd

        self.client = etcd.Client(host=HOST, port=self.port, read_timeout=60)

    def lock(self, name: str) -> Any:
        import etcd

        impl = self

        class Handle:
            def __init__(self) -> None:
                self.lock = etcd.Lock(impl.client, name)

            def acquire(self) -> bool:
                while True:
                    try:
                        return bool(self.lock.acquire(blocking=True, lock_ttl=int(impl.ttl)))
                    except etcd.EtcdLockExpired:
                        # its queue key is never renewed: a wait longer than lock_ttl loses it; queue again
                        self.lock = etcd.Lock(impl.client, name)

            def release(self) -> None:
                self.lock.release()

        return Handle()


class ToozEtcd3gw(Impl):
    """tooz's etcd3gw driver: lock_timeout = our ttl, heartbeat thread on, tooz defaults otherwise."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        from tooz import coordination

        url = f"etcd3+http://{HOST}:{self.port}?lock_timeout={int(ttl)}"
        self.coordinator = coordination.get_coordinator(url, uuid.uuid4().hex.encode())
        self.coordinator.start(start_heart=True)

    def lock(self, name: str) -> Any:
        return self.coordinator.get_lock(f"/{name}".encode())

    def on_renewal(self, handle: Any, callback: Callable[[], None]) -> bool:
        lease_id = str(handle._lease.id)  # the heartbeat refreshes the membership lease, then this one

        call_on_http_request(lambda method, url, body: "/lease/keepalive" in url and lease_id in body, callback)
        return True

    def close(self) -> None:
        self.coordinator.stop()


class RedisLock(Impl):
    """python-redis-lock: expire = our ttl, auto_renewal on (renews every 2/3 of it)."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import redis

        self.client = redis.Redis(host=HOST, port=self.port)

    def lock(self, name: str) -> Any:
        import redis_lock

        return redis_lock.Lock(self.client, name, expire=int(self.ttl), auto_renewal=True)

    def on_renewal(self, handle: Any, callback: Callable[[], None]) -> bool:
        extend = handle.extend

        def extend_and_tell(*args: Any, **kwargs: Any) -> Any:
            result = extend(*args, **kwargs)
            callback()
            return result

        handle.extend = extend_and_tell
        return True

    def close(self) -> None:
        self.client.close()


class FloorHandle:
    """A floor's "lock": ``create(key)`` must succeed (the key is free), then ``delete(key)``."""

    def __init__(self, create: Callable[[str], Any], delete: Callable[[str], Any], key: str) -> None:
        self._create, self._delete, self.key = create, delete, key

    def acquire(self) -> bool:
        if not self._create(self.key):
            raise RuntimeError(f"floor key {self.key} exists")
        return True

    def release(self) -> None:
        self._delete(self.key)


class RawV2(Impl):
    """The v2 floor: one create (prevExist=false) and one delete with python-etcd."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import etcd

        self.client = etcd.Client(host=HOST, port=self.port, read_timeout=60)

    def lock(self, name: str) -> Any:
        ttl = int(self.ttl)  # python-etcd raises EtcdAlreadyExist if the key exists
        return FloorHandle(
            lambda key: self.client.write(key, "x", ttl=ttl, prevExist=False), self.client.delete, f"/floor/{name}"
        )


class RawV3(Impl):
    """The v3 floor: etcd3gw's create (one put-if-absent transaction) and delete."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import etcd3gw

        self.client = etcd3gw.client(host=HOST, port=self.port)

    def lock(self, name: str) -> Any:
        return FloorHandle(lambda key: self.client.create(key, "x"), self.client.delete, f"/floor/{name}")


class RawRedis(Impl):
    """The Redis floor: SET NX EX and DEL."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import redis

        self.client = redis.Redis(host=HOST, port=self.port)

    def lock(self, name: str) -> Any:
        ttl = int(self.ttl)
        return FloorHandle(lambda key: self.client.set(key, "x", nx=True, ex=ttl), self.client.delete, f"floor:{name}")

    def close(self) -> None:
        self.client.close()


IMPLS: dict[str, type[Impl]] = {
    "floor-v2": RawV2,
    "ours-v2": OursMutex,
    "etcd.Lock": EtcdLock,
    "floor-v3": RawV3,
    "ours-v3": OursMutex,
    "tooz-etcd3gw": ToozEtcd3gw,
    **{f"floor-v3-{line}": RawV3 for line in OTHER_V3_LINES},
    **{f"ours-v3-{line}": OursMutex for line in OTHER_V3_LINES},
    **{f"tooz-etcd3gw-{line}": ToozEtcd3gw for line in OTHER_V3_LINES},
    "floor-redis": RawRedis,
    "redis-lock": RedisLock,
}


def make_impl(kind: str, ports: dict[str, int], ttl: float) -> Impl:
    return IMPLS[kind](kind, ports, ttl)
