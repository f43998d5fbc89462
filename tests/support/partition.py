"""Real network partitions between the etcd members of a cluster on loopback, with iptables.

Ports alone cannot tell which member sent a packet: a member dials the others from
ephemeral ports. So every member runs with a group id of its own, and while the cluster
lives a chain of ours, jumped to from OUTPUT on ``lo``, marks each TCP connection a
member opens with that group id (``-m owner --gid-owner G -j CONNMARK --set-mark G``).
conntrack keeps the mark for both directions of the connection. Cutting member i off
then takes two kinds of rules, in a second chain:

- drop every packet of a connection made to i's peer port (the others dialling i, and
  i's answers): ``-m conntrack --ctorigdstport P_i -j DROP``;
- drop every packet of a connection that i made to another member's peer port (i
  dialling the others, and their answers): ``-m connmark --mark G_i -m conntrack
  --ctorigdstport P_j -j DROP``.

Client ports are left alone: clients still reach member i, which can no longer answer
anything that needs a quorum. Packets are dropped, not rejected: the others see
silence, as in a real partition, not a refused connection.

A partition needs root and a working ``iptables`` (nft or legacy: the probe tries the
very rules used here). ``partition_unsupported()`` says why not, for a clean skip.
The chains are named ``ETCDLOCK-<pid>-<n>`` (and ``...-CUT``). ``close()`` removes them;
at exit, this process's leftovers are removed; a run killed outright leaves chains whose
pid is gone, and the next firewall made removes them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import re
import shutil
import subprocess

CHAIN_PREFIX = "ETCDLOCK-"
MEMBER_GID_BASE = 48_100  # member i runs with group MEMBER_GID_BASE + i (no file of theirs needs it)

_counter = itertools.count(1)
_open: set[PeerFirewall] = set()


class FirewallError(RuntimeError):
    """An iptables command failed (with its stderr)."""


class PartitionUnsupported(FirewallError):
    """This machine cannot partition members (not root, no iptables, or a rule iptables refuses)."""


def _iptables_binary() -> str | None:
    return shutil.which("iptables") or shutil.which("iptables", path="/usr/sbin:/sbin")


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # -w: wait for the xtables lock that other processes' iptables may hold
    command = [_iptables_binary() or "iptables", "-w", "10", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise FirewallError(f"iptables {' '.join(args)} failed: {done.stderr.strip()}")
    return done


@functools.cache
def partition_unsupported() -> str | None:
    """Why this machine cannot partition members, or None when it can. Probed once per process."""
    if os.geteuid() != 0:
        return "a network partition needs root (iptables rules on lo)"
    if _iptables_binary() is None:
        return "a network partition needs iptables (apt-get install iptables; scripts/setup-system does)"
    probe = f"{CHAIN_PREFIX}{os.getpid()}-PROBE"
    try:
        _iptables("-N", probe)
        _iptables("-A", probe, *_mark_rule(MEMBER_GID_BASE))
        _iptables("-A", probe, *_cut_dialled_by(MEMBER_GID_BASE, 1))
        _iptables("-A", probe, *_cut_dialled_to(1))
    except (FirewallError, OSError, subprocess.SubprocessError) as exc:
        return f"iptables cannot make the partition rules here: {exc}"
    finally:
        _iptables("-F", probe, check=False)
        _iptables("-X", probe, check=False)
    return None


def _mark_rule(gid: int) -> list[str]:
    return ["-p", "tcp", "-m", "owner", "--gid-owner", str(gid), "-m", "conntrack", "--ctstate", "NEW",
            "-j", "CONNMARK", "--set-mark", str(gid)]  # fmt: skip


def _cut_dialled_by(gid: int, peer_port: int) -> list[str]:
    return ["-p", "tcp", "-m", "connmark", "--mark", str(gid), "-m", "conntrack", "--ctorigdstport", str(peer_port),
            "-j", "DROP"]  # fmt: skip


def _cut_dialled_to(peer_port: int) -> list[str]:
    return ["-p", "tcp", "-m", "conntrack", "--ctorigdstport", str(peer_port), "-j", "DROP"]


def our_chains() -> list[str]:
    """The chains of ours (any process's) that iptables has now."""
    listing = _iptables("-S", check=False).stdout
    return re.findall(rf"^-N ({re.escape(CHAIN_PREFIX)}\S+)$", listing, re.M)


def _remove_chain(chain: str) -> None:
    """Remove ``chain``: every OUTPUT rule that jumps to it, then its rules, then itself."""
    for rule in _iptables("-S", "OUTPUT", check=False).stdout.splitlines():
        if rule.startswith("-A OUTPUT ") and rule.endswith(f" -j {chain}"):
            _iptables("-D", *rule.split()[1:], check=False)
    _iptables("-F", chain, check=False)
    _iptables("-X", chain, check=False)


def _remove_chains_of_dead_runs() -> None:
    for chain in our_chains():
        found = re.match(rf"{re.escape(CHAIN_PREFIX)}(\d+)-", chain)
        if not found:
            continue
        try:
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:
            _remove_chain(chain)
        except PermissionError:
            pass  # alive, someone else's


class PeerFirewall:
    """The iptables chains that can cut one member of a cluster off from the others.

    ``members``: each member's (group id, peer port). ``install()`` before the members start
    (their connections must be marked from the first one), ``cut(i)``, ``heal()``, ``close()``.
    """

    def __init__(self, members: list[tuple[int, int]]) -> None:
        reason = partition_unsupported()
        if reason:
            raise PartitionUnsupported(reason)
        self.members = members
        self.chain = f"{CHAIN_PREFIX}{os.getpid()}-{next(_counter)}"
        self.cut_chain = f"{self.chain}-CUT"
        self.cut_off: set[int] = set()
        self.installed = False

    def install(self) -> None:
        _remove_chains_of_dead_runs()
        _open.add(self)
        self.installed = True
        _iptables("-N", self.cut_chain)
        _iptables("-N", self.chain)
        for gid, _ in self.members:
            _iptables("-A", self.chain, *_mark_rule(gid))
        _iptables("-A", self.chain, "-j", self.cut_chain)
        _iptables("-I", "OUTPUT", "-o", "lo", "-p", "tcp", "-j", self.chain)

    def cut(self, index: int) -> None:
        """Drop all peer traffic between member ``index`` and the others, both ways."""
        gid, peer_port = self.members[index]
        _iptables("-A", self.cut_chain, *_cut_dialled_to(peer_port))
        for other, (_, other_port) in enumerate(self.members):
            if other != index:
                _iptables("-A", self.cut_chain, *_cut_dialled_by(gid, other_port))
        self.cut_off.add(index)

    def heal(self) -> None:
        """Remove every cut."""
        _iptables("-F", self.cut_chain)
        self.cut_off.clear()

    def rules(self) -> list[str]:
        """The rules of both chains now, as ``iptables -S`` prints them (for tests and error messages)."""
        return [
            line
            for chain in (self.chain, self.cut_chain)
            for line in _iptables("-S", chain, check=False).stdout.splitlines()
            if line.startswith("-A ")
        ]

    def leftover_chains(self) -> list[str]:
        """This firewall's chains that iptables still has (none after ``close()``)."""
        return [chain for chain in our_chains() if chain in (self.chain, self.cut_chain)]

    def close(self) -> None:
        """Remove the jump from OUTPUT and both chains. Safe to call twice."""
        if self.installed:
            _remove_chain(self.chain)
            _remove_chain(self.cut_chain)
            self.installed = False
        self.cut_off.clear()
        _open.discard(self)


@atexit.register
def _close_leftovers() -> None:
    for firewall in list(_open):
        with contextlib.suppress(Exception):
            firewall.close()
