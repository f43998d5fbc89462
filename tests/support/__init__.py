"""Real servers for the tests: etcd (one member, or a cluster of three) and Redis, on loopback.

    ports.py         free loopback ports (port-for)
    wait.py          wait_until: a poll with a deadline, never a sleep
    process.py       ServerProcess, the one base of every server (mirakuru): start, health check,
                     stop, kill, pause/resume, restart on the same ports, log tail, cleanup
    tls.py           make_certificates: a throw-away CA, server and client certs
    etcd_versions.py which etcd: the releases scripts/etcd-build made, the test kinds over them
    etcd_server.py   EtcdServer: etcd 3.4 (v2 and v3), 3.5 (v2 or v3), 3.6, 3.7 (v3), TLS, auth, /metrics
    redis_server.py  RedisServer, with a redis-py client
    cluster.py       EtcdCluster: three members, leader, kill/pause/restart, quorum loss
    partition.py     the iptables rules that cut one member off from the others
    celery_processes.py  CeleryProcesses: real celery beat and worker processes of a test app, with logs

Nothing here mocks anything: every server is a real process, killed for real. Only
127.0.0.1 is used, never a fixed port, so parallel runs and a system etcd on 2379 do not
matter. The names most tests need are importable from here.
"""

from tests.support.cluster import EtcdCluster, EtcdMember
from tests.support.etcd_server import APP_PASSWORD, APP_USER, ROOT_PASSWORD, ROOT_USER, EtcdServer, etcd_binary
from tests.support.partition import PartitionUnsupported, partition_unsupported
from tests.support.ports import HOST, free_port
from tests.support.process import ServerError
from tests.support.redis_server import RedisServer
from tests.support.tls import make_certificates
from tests.support.wait import TimedOut, wait_until

__all__ = [
    "APP_PASSWORD",
    "APP_USER",
    "HOST",
    "ROOT_PASSWORD",
    "ROOT_USER",
    "EtcdCluster",
    "EtcdMember",
    "EtcdServer",
    "PartitionUnsupported",
    "RedisServer",
    "ServerError",
    "TimedOut",
    "etcd_binary",
    "free_port",
    "make_certificates",
    "partition_unsupported",
    "wait_until",
]
