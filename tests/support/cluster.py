"""A real 3-member etcd cluster on loopback, and the faults an operator fears, for real.

    with EtcdCluster("3.4") as cluster:             # etcd 3.4, v2 and v3 APIs; "3.5": v3 only
        client = connect(cluster.url(order=[2, 0, 1], prefix="/t"))   # all three endpoints
        leader = cluster.wait_for_leader()          # the index of the member a quorum follows
        cluster.member(leader).kill()               # SIGKILL; .restart(), .pause(), .resume()
        cluster.partition(1); cluster.heal()        # cut member 1's peer traffic (clients still reach it)
        cluster.stop_quorum(); cluster.restore()    # two members down, then back
        cluster.rolling_restart()                   # one member at a time, the leader last

Each member is an EtcdServer (its own ports, temp dir and log) whose flags name all three.
Raft runs faster than etcd's defaults (HEARTBEAT_MS, ELECTION_MS) so that a lost leader is
replaced within about a second; the timings stay well above what fsync takes on a loaded
2-core machine, where a slower heartbeat would cause elections nobody asked for.
"""

from __future__ import annotations

import base64
import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.support.etcd_server import EtcdServer
from tests.support.partition import MEMBER_GID_BASE, PartitionUnsupported, PeerFirewall, partition_unsupported
from tests.support.ports import free_port
from tests.support.process import PORT_RETRIES, START_TIMEOUT, ServerError
from tests.support.wait import wait_until

HEARTBEAT_MS = 50  # etcd's default: 100
ELECTION_MS = 500  # etcd's default: 1000; etcd wants at least 5 heartbeats


class EtcdMember(EtcdServer):
    """One member of an EtcdCluster: the cluster gives it its ports, its peers and its group id."""

    def __init__(self, cluster: EtcdCluster, index: int) -> None:
        super().__init__(cluster.version, enable_v2=cluster.enable_v2, api=cluster.api, name=f"member{index}")
        self.cluster = cluster
        self.index = index
        self.gid: int | None = None  # set when the cluster can partition: see partition.py
        self.member_id: str | None = None  # raft's id of this member, learnt from its status

    def choose_ports(self) -> None:
        raise ServerError(f"{self!r}: a member's ports are chosen by its cluster")

    def cluster_flags(self) -> list[str]:
        return [
            f"--initial-cluster={self.cluster.initial_cluster()}",
            f"--initial-cluster-token={self.cluster.token}",
            "--initial-cluster-state=new",  # ignored on a restart: the data dir has the cluster
            f"--heartbeat-interval={self.cluster.heartbeat_ms}",
            f"--election-timeout={self.cluster.election_ms}",
        ]

    def popen_kwargs(self) -> dict[str, Any]:
        return {"group": self.gid} if self.gid is not None else {}

    def status(self, timeout: float = 1.0) -> dict[str, Any] | None:
        """/v3/maintenance/status (member id, leader id, raft term and index), or None if it does not answer."""
        if not self.running or self.paused:
            return None
        status, reply = self.v3("maintenance/status", {}, timeout=timeout)
        if status != 200:
            return None
        self.member_id = reply.get("header", {}).get("member_id", self.member_id)
        return reply

    def __repr__(self) -> str:
        state = "paused" if self.paused else "running" if self.running else "down"
        return f"<EtcdMember {self.index} of etcd {self.version} {self.endpoint} peer {self.peer_port} {state}>"


class EtcdCluster:
    """Three real etcd members on loopback, each with its own client and peer port.

    ``version``: "3.4" (Debian's etcd, v2 and v3 APIs: ``enable_v2`` defaults to True) or
    "3.5", "3.6" or "3.7" (scripts/etcd-build; v3 only by default). ``api`` picks the URL scheme as for EtcdServer.
    Network partitions need root and iptables (see partition.py); elsewhere the cluster works
    and ``partition()`` raises PartitionUnsupported, whose message says why.
    """

    def __init__(
        self,
        version: str = "3.4",
        enable_v2: bool | None = None,
        api: str | None = None,
        size: int = 3,
        heartbeat_ms: int = HEARTBEAT_MS,
        election_ms: int = ELECTION_MS,
    ) -> None:
        self.version = version
        self.enable_v2 = version == "3.4" if enable_v2 is None else enable_v2
        self.api = api or ("v2" if self.enable_v2 else "v3")
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.token = f"etcdlock-cluster-{uuid.uuid4().hex[:12]}"
        self.members: list[EtcdMember] = []
        self.firewall: PeerFirewall | None = None
        try:
            self.members = [EtcdMember(self, i) for i in range(size)]
        except BaseException:
            self.close()
            raise

    @property
    def quorum(self) -> int:
        return len(self.members) // 2 + 1

    def member(self, index: int) -> EtcdMember:
        return self.members[index]

    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    # -- addresses

    @property
    def endpoints(self) -> list[str]:
        """The members' client endpoints, "127.0.0.1:port", in member order."""
        return [m.endpoint for m in self.members]

    def url(
        self, order: list[int] | None = None, scheme: str | None = None, prefix: str | None = None, **options: Any
    ) -> str:
        """A celery_etcdlock URL naming every member, e.g. ``etcd://127.0.0.1:4001,127.0.0.1:4003,...``.

        ``order``: the members' indices in the order the URL lists them (default 0, 1, 2).
        """
        order = list(range(len(self.members))) if order is None else order
        if sorted(order) != list(range(len(self.members))):
            raise ValueError(f"order must list each member once, not {order}")
        return self.members[0].url_for([self.members[i].endpoint for i in order], scheme, prefix, **options)

    def shuffled_url(self, rng: random.Random, **options: Any) -> str:
        """``url()`` with the members in a random order (from ``rng``, for reproducible runs)."""
        order = list(range(len(self.members)))
        rng.shuffle(order)
        return self.url(order, **options)

    # -- life cycle

    def start(self) -> EtcdCluster:
        """Start all members at once (each waits for a leader) on fresh ports; retry if a port was taken."""
        if partition_unsupported() is None:
            for member in self.members:
                member.gid = MEMBER_GID_BASE + member.index
        for attempt in range(PORT_RETRIES):
            for member in self.members:
                member.client_port, member.peer_port = free_port(), free_port()
            if self.members[0].gid is not None:
                self.firewall = PeerFirewall([(m.gid or 0, m.peer_port) for m in self.members])
                self.firewall.install()
            try:
                self._start_members(self.members)
                return self
            except ServerError:
                lost_port_race = any("address already in use" in m.log_tail(30).lower() for m in self.members)
                self._kill_all()
                if self.firewall is not None:
                    self.firewall.close()
                if not lost_port_race or attempt == PORT_RETRIES - 1:
                    raise
                for member in self.members:
                    member.forget_data()
        raise AssertionError("unreachable")

    def _start_members(self, members: list[EtcdMember]) -> None:
        """Start ``members`` together: a member is healthy only once a quorum of them runs."""
        if not members:
            return
        with ThreadPoolExecutor(len(members)) as pool:
            failures = [f.exception() for f in [pool.submit(m.start) for m in members]]
        errors = [e for e in failures if e is not None]
        if errors:
            raise ServerError("; ".join(str(e) for e in errors)) from errors[0]

    def _kill_all(self) -> None:
        for member in self.members:
            member.kill()

    def close(self) -> None:
        """Kill every member, remove their temp dirs, and remove the firewall's rules."""
        try:
            self._kill_all()
            for member in self.members:
                member.close()
        finally:
            if self.firewall is not None:
                self.firewall.close()

    def leftover_chains(self) -> list[str]:
        """The iptables chains of this cluster that still exist (none once it is closed)."""
        return self.firewall.leftover_chains() if self.firewall is not None else []

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<EtcdCluster etcd {self.version} api={self.api} {', '.join(self.endpoints)}>"

    # -- who leads

    def leader(self, timeout: float = 1.0) -> int | None:
        """The index of the member that a quorum of members names as leader now, or None.

        Asks each running member (not a paused one) for its /v3/maintenance/status.
        """
        statuses = [m.status(timeout) for m in self.members]
        claims: dict[str, int] = {}
        for status in statuses:
            if status is not None and status.get("leader", "0") != "0":
                claims[status["leader"]] = claims.get(status["leader"], 0) + 1
        for member_id, votes in claims.items():
            if votes >= self.quorum:
                for member in self.members:
                    if member.member_id == member_id:
                        return member.index
        return None

    def wait_for_leader(self, timeout: float = 30.0, other_than: int | None = None) -> int:
        """Poll ``leader()`` until a quorum follows a member (not ``other_than``); return its index."""

        def elected() -> tuple[int] | None:  # a tuple: member 0 must count as found
            found = self.leader()
            return (found,) if found is not None and found != other_than else None

        what = "a leader" if other_than is None else f"a leader other than member {other_than}"
        return wait_until(elected, timeout, what)[0]

    def move_leader(self, index: int, timeout: float = 30.0) -> None:
        """Make member ``index`` the raft leader: etcd's MoveLeader, asked of the leader, until a quorum follows it.

        So that a test can choose which member a fault hits as the leader, or as a follower.
        """

        def led_by_index() -> bool:
            leader = self.leader()
            if leader == index:
                return True
            target = self.members[index].status()
            if leader is not None and target is not None:
                body = {"targetID": target["header"]["member_id"]}
                self.members[leader].v3("maintenance/transfer-leadership", body, timeout=5)
            return False

        wait_until(led_by_index, timeout, f"member {index} to lead", interval=0.2)

    # -- faults

    def partition(self, index: int) -> None:
        """Cut member ``index``'s peer traffic with the others, both ways; its client port stays reachable."""
        if self.firewall is None:
            reason = partition_unsupported()
            raise PartitionUnsupported(reason) if reason else ServerError("start the cluster before partitioning it")
        self.firewall.cut(index)

    def heal(self) -> None:
        """End every partition."""
        if self.firewall is not None:
            self.firewall.heal()

    def stop_quorum(self, keep: int | None = None, crash: bool = True) -> list[int]:
        """SIGKILL every member but ``keep`` (default: the leader, or member 0): the cluster loses its quorum.

        ``crash=False``: stop them cleanly (SIGTERM) instead. Returns the indices stopped, for ``restore()``.
        """
        if keep is None:
            keep = self.leader()
            keep = 0 if keep is None else keep
        killed = [m.index for m in self.members if m.index != keep and m.running]
        for index in killed:
            if crash:
                self.members[index].kill()
            else:
                self.members[index].stop()
        return killed

    def diverged(self, timeout: float = 30.0) -> str | None:
        """How the members' copies of the data differ, or None: a write through the leader, read back from each.

        Every member applies the same raft log, so each gives the key written the same revision;
        a member that skipped an entry gives it another one, for good. etcd 3.5.0 to 3.5.2 can do
        that to a member killed by SIGKILL (etcd-io/etcd#13766, fixed in 3.5.3): the test of a
        client is then void. Each member is read alone (a serializable read), once it has the key.
        """
        leader = self.wait_for_leader()
        key = base64.b64encode(f"/etcdlock-consistency/{uuid.uuid4().hex}".encode()).decode()
        status, reply = self.members[leader].v3("kv/put", {"key": key, "value": key})
        if status != 200:
            raise ServerError(f"the consistency marker could not be written through member {leader}: {reply}")

        def revisions() -> dict[int, int] | None:
            seen = {}
            for member in self.members:
                status, reply = member.v3("kv/range", {"key": key, "serializable": True}, timeout=2)
                kvs = reply.get("kvs") if status == 200 else None
                if not kvs:
                    return None
                seen[member.index] = int(kvs[0]["mod_revision"])
            return seen

        seen = wait_until(revisions, timeout, "every member to apply the consistency marker")
        if len(set(seen.values())) > 1:
            return f"the members give one key different revisions (member: revision): {seen}"
        return None

    def restore(self) -> None:
        """Start every member that is down, together, and wait until a quorum follows a leader."""
        for member in self.members:
            if member.paused:
                member.resume()
        self._start_members([m for m in self.members if not m.running])
        self.wait_for_leader()

    def rolling_restart(self, kill: bool = False) -> list[int]:
        """Restart the members one at a time, as an operator upgrades them: followers first, the leader last.

        Each member is back and healthy, and the cluster has a leader, before the next one goes.
        ``kill``: SIGKILL instead of a clean SIGTERM. Returns the order used.
        """
        leader = self.wait_for_leader()
        order = [m.index for m in self.members if m.index != leader] + [leader]
        for index in order:
            member = self.members[index]
            if kill:
                member.kill()
            member.restart()
            self.wait_for_leader(START_TIMEOUT)
        return order
