"""Start child processes that die with the process that started them (Linux), for test servers.

``popen(argv, **kwargs)`` is ``subprocess.Popen(argv, **kwargs)``, except that on Linux the
child gets SIGKILL when this process dies, however it dies: a pytest killed by CI's
``timeout`` (SIGKILL, no atexit, no fixture teardown) leaves no etcd, Redis, PostgreSQL or
Celery process behind. Elsewhere it is plain ``Popen``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any, TypeVar

T = TypeVar("T")

# Why a wrapper and not preexec_fn: preexec_fn runs Python between fork and exec, which can
# deadlock in a process with threads (a test process has many: renewers, readers, watchers).
# The wrapper is a fresh Python (-I -S: nothing from the environment or site-packages) that sets
# the death signal and then execs the command: the pid, session, environment and open files stay
# the child's, so signals, kills and restarts of it work as before.
# The wrapper, not Popen, drops to user=/group=/extra_groups: a change of credentials clears the
# death signal, so it must come first; and that user may not be allowed to run our Python (a venv
# under /root), so the wrapper must start before it. execve keeps the death signal.
# The getppid() check: if the parent died between the fork and prctl(), no signal will ever
# come (the child has been reparented already), so the wrapper must not exec at all.
_WRAPPER = """\
import ctypes, os, sys
parent, uid, gid, groups, *argv = sys.argv[1:]
if groups != "-":
    os.setgroups([int(g) for g in groups.split(",") if g])
if gid:
    os.setregid(int(gid), int(gid))
if uid:
    os.setreuid(int(uid), int(uid))
if ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(parent):
    sys.exit("the parent process died before the child started")
try:
    os.execvp(argv[0], argv)
except OSError as error:
    sys.stderr.write(f"cannot run {argv[0]!r}: {error}\\n")
    os._exit(127)
"""

SUPPORTED = sys.platform.startswith("linux")


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **kwargs)`` whose child gets SIGKILL when this process dies (Linux)."""
    if not SUPPORTED:
        return subprocess.Popen(argv, **kwargs)
    import pwd  # POSIX only

    user, group, extra_groups = kwargs.pop("user", None), kwargs.pop("group", None), kwargs.pop("extra_groups", None)
    uid = "" if user is None else str(user if isinstance(user, int) else pwd.getpwnam(user).pw_uid)
    gid = "" if group is None else str(_gid(group))
    groups = "-" if extra_groups is None else ",".join(str(_gid(g)) for g in extra_groups)
    wrapped = [sys.executable, "-I", "-S", "-c", _WRAPPER, str(os.getpid()), uid, gid, groups, *argv]
    return in_lasting_thread(lambda: subprocess.Popen(wrapped, **kwargs))


def _gid(group: int | str) -> int:
    import grp  # POSIX only

    return group if isinstance(group, int) else grp.getgrnam(group).gr_gid


# Why a thread of its own: Linux sends the death signal when the *thread* that forked the child
# ends, not the process. Fixtures start servers from short-lived threads (a cluster starts its
# members in a thread pool): those servers would be killed the moment the pool shut down. So
# every fork happens on a thread that lives as long as the process: the main thread (it ends
# only with the process), or else one daemon thread kept for the purpose. Only the fork and exec
# run there; the Popen object is used from any thread afterwards, as before.
_lock = threading.Lock()
_spawner: tuple[int, SimpleQueue[tuple[Callable[[], Any], Future[Any]]]] | None = None


def in_lasting_thread(call: Callable[[], T]) -> T:
    """Run ``call`` on a thread that lives until this process exits (on the main thread as is)."""
    if not SUPPORTED or threading.current_thread() is threading.main_thread():
        return call()
    done: Future[T] = Future()
    _requests().put((call, done))
    return done.result()


def _requests() -> SimpleQueue[tuple[Callable[[], Any], Future[Any]]]:
    global _spawner
    with _lock:
        if _spawner is None or _spawner[0] != os.getpid():  # a forked child has no copy of the thread
            requests: SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = SimpleQueue()
            # not named etcdlock-...: tests/forkcheck.py counts those as the package's own threads
            threading.Thread(target=_serve, args=(requests,), name="child-spawner", daemon=True).start()
            _spawner = (os.getpid(), requests)
        return _spawner[1]


def _serve(requests: SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
    while True:
        call, done = requests.get()
        try:
            done.set_result(call())
        except BaseException as error:  # handed to the caller, who raises it
            done.set_exception(error)
