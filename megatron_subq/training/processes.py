"""Process lifetimes and the ``--save`` lock: nothing a run starts outlives it, and two runs never
write one save folder.

* **Workers die with their torchrun agent.** Under torchrun (``TORCHELASTIC_RUN_ID`` in the
  environment) ``die_with_launcher`` asks Linux to SIGKILL the worker when the agent dies
  (``prctl(PR_SET_PDEATHSIG)``), so killing the agent no longer leaves workers training and saving
  as orphans. Without torchrun (``python pretrain_gpt.py``) the parent is a shell and nothing is
  set: a run started under ``nohup`` keeps running.
* **Helpers die with their worker.** megatron-core's torch_dist save (``filesystem_async.py``)
  forks one writer per write bucket and, once per process, *spawns* a ``multiprocessing`` Manager
  (its results queue; the spawned child re-imports the main module, ~1 GB with CUDA); when a
  worker is killed (``kill -9``), torchrun only kills the process groups of workers still running,
  so the Manager lived on forever. ``install_child_reaping`` makes every child forked from the
  main thread get PDEATHSIG (``os.register_at_fork``) and starts that Manager with an initializer
  that does the same (a spawned child starts from ``exec``: a fork hook cannot reach it).
  multiprocessing's resource tracker exits by itself once the worker and the Manager are gone.
* **The save lock.** ``lock_save_folder`` takes ``SAVE/save.lock`` (``fcntl.flock``, released by
  the kernel when its holder dies, however it dies) and writes the holder's PID and host into it
  for the message a second run gets. A lock file left by a dead run is taken over with a note.

All of it is Linux-only and a no-op elsewhere (with a one-time note).
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import json
import os
import signal
import socket
import sys
import threading
from typing import Callable, Optional

LOCK_NAME = "save.lock"
PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
_LINUX = sys.platform.startswith("linux")
# libc is opened here, in the parent: the fork hook runs in a child forked from a possibly
# multi-threaded process, where dlopen could deadlock on the loader's lock
_LIBC = ctypes.CDLL(None, use_errno=True) if _LINUX else None

_noted_unsupported = False
_fork_hook_registered = False
_reaping = False  # the fork hook acts only while this is on (install/uninstall_child_reaping)
_fork_origin = threading.local()  # set in the parent just before a fork, read in the child
_original_results_queue: Optional[Callable] = None


def _note_unsupported(log: Callable) -> None:
    global _noted_unsupported
    if not _noted_unsupported:
        _noted_unsupported = True
        log(f"> note: on {sys.platform} worker and checkpoint-writer processes are not tied to "
            "their parent (PR_SET_PDEATHSIG is Linux-only): kill leftovers by hand")


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: Optional[int] = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux only: returns
    False elsewhere, True once set).

    The parent may die before the call, when it is too late for the kernel to notice: the parent
    is read before (or given as ``expected_parent``, the PID that forked us) and again after the
    ``prctl``; if it changed (we were re-parented), ``sig`` is sent to ourselves at once.
    Linux counts the *thread* that forked us as the parent: only call this in a child created
    from a long-lived thread (the main thread)."""
    if not _LINUX:
        return False
    parent = os.getppid() if expected_parent is None else expected_parent
    if _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, {int(sig)}): {os.strerror(err)}")
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os.kill(os.getpid(), sig)
    return True


def parent_death_signal() -> int:
    """This process's PDEATHSIG (0 = none; always 0 off Linux)."""
    if not _LINUX:
        return 0
    value = ctypes.c_int(0)
    if _LIBC.prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_GET_PDEATHSIG): {os.strerror(err)}")
    return value.value


def under_torchrun() -> bool:
    """True in a worker started by torchrun's elastic agent (which sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _before_fork() -> None:
    _fork_origin.pid = os.getpid()
    _fork_origin.main = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    # only children of the main thread: a child of a short-lived thread would be killed when
    # that thread ends (Linux's PDEATHSIG follows the forking thread)
    if _reaping and getattr(_fork_origin, "main", False):
        die_with_parent(signal.SIGKILL, expected_parent=_fork_origin.pid)


# What megatron's spawned Manager runs first (``exec`` of this text, the worker's PID formatted
# in): die_with_parent without importing this package, whose import would cost the Manager the
# whole of megatron_subq and megatron-core (seconds, hundreds of MB) at every run's first save.
_MANAGER_INITIALIZER = """
import ctypes, os, signal
ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, int(signal.SIGKILL), 0, 0, 0)
if os.getppid() != {worker}:
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _results_queue_dying_with_worker():
    """megatron's ``filesystem_async._get_write_results_queue``, its Manager started with
    ``_MANAGER_INITIALIZER`` (a spawned child: the fork hook does not reach it)."""
    from multiprocessing.managers import SyncManager  # noqa: PLC0415

    from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: PLC0415
    from torch import multiprocessing as mp  # noqa: PLC0415

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        code = _MANAGER_INITIALIZER.format(PR_SET_PDEATHSIG=PR_SET_PDEATHSIG, worker=os.getpid())
        manager.start(exec, (code, {}))
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
    return filesystem_async._results_queue


def install_child_reaping(log: Callable = print) -> bool:
    """Make this process's helper children die with it: children forked from the main thread
    (megatron's checkpoint writers, DataLoader workers) and megatron's spawned save Manager.
    Idempotent; undone by ``uninstall_child_reaping``. Returns False (one note) off Linux."""
    global _fork_hook_registered, _reaping, _original_results_queue
    if not _LINUX:
        _note_unsupported(log)
        return False
    if not _fork_hook_registered:  # a fork hook cannot be unregistered: it checks _reaping
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _fork_hook_registered = True
    _reaping = True
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: PLC0415
    except ImportError:
        return True
    if (_original_results_queue is None
            and hasattr(filesystem_async, "_get_write_results_queue")):
        _original_results_queue = filesystem_async._get_write_results_queue
        filesystem_async._get_write_results_queue = _results_queue_dying_with_worker
    return True


def uninstall_child_reaping() -> None:
    """Back to megatron's own behaviour for children created from now on (a Manager already
    started keeps its PDEATHSIG: megatron reuses it for the life of the process)."""
    global _reaping, _original_results_queue
    _reaping = False
    if _original_results_queue is not None:
        from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: PLC0415

        filesystem_async._get_write_results_queue = _original_results_queue
        _original_results_queue = None


def die_with_launcher(log: Callable = print) -> bool:
    """A torchrun worker dies (SIGKILL) when its elastic agent dies; no-op without torchrun
    (the parent is then a shell or a test). Returns True if set. SIGKILL, not SIGTERM: a worker
    blocked in a collective, or one whose libraries handle SIGTERM, would otherwise go on; the
    save lock and the helpers (PDEATHSIG of their own) need no clean-up code to run."""
    if not under_torchrun():
        return False
    if not _LINUX:
        _note_unsupported(log)
        return False
    return die_with_parent(signal.SIGKILL)


def install_process_lifetimes(log: Callable = print) -> None:
    """At trainer start-up: a torchrun worker dies with its agent, and helpers with the worker."""
    die_with_launcher(log)
    install_child_reaping(log)


# ------------------------------------------------------------------------------------------------
# the --save lock
# ------------------------------------------------------------------------------------------------
class SaveFolderLocked(RuntimeError):
    """Another live process holds the save folder's lock."""


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode("utf-8", "replace").strip()
        holder = json.loads(text) if text else {}
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict, held: bool = False) -> str:
    if not holder:
        return "a process that left no PID"
    text = (f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}"
            + (f" (since {holder['started']})" if holder.get("started") else ""))
    pid = holder.get("pid")
    if held and holder.get("host") == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            text += (", which is no longer running: a child process it started (a checkpoint "
                     "writer?) still holds the lock")
        except OSError:
            pass
    return text


class SaveLock:
    """An exclusive lock on a save folder: ``SaveLock(folder).acquire()`` ... ``release()``.

    The lock is ``fcntl.flock`` on ``FOLDER/save.lock``: the kernel drops it when the holder
    dies, so a lock file left by a crashed run is taken over (with a note). The file records the
    holder's PID, host and start time, which the error of a second run names. ``release`` deletes
    the file; a taker checks that the file it locked is still the one in the folder."""

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self._fd: Optional[int] = None

    def acquire(self, log: Callable = print) -> "SaveLock":
        import fcntl  # noqa: PLC0415 - POSIX only

        os.makedirs(self.folder, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise SaveFolderLocked(
                        f"`--save {self.folder}` is in use by another run: its lock file "
                        f"{self.path} is held by {_describe(holder, held=True)}. Two runs must "
                        "not write one save folder: stop that run or pick another --save"
                    ) from None
                log(f"> note: cannot lock {self.path} ({os.strerror(e.errno)}: this file system "
                    "has no flock); a second run writing this --save folder is not detected")
                return self
            try:  # a holder releasing meanwhile deletes the file it locked: lock the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read_holder(fd)
        if stale:
            log(f"> note: taking over the stale lock {self.path} of {_describe(stale)}: that "
                "process is gone (it did not release it)")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": datetime.datetime.now().isoformat(timespec="seconds")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (record + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Delete the lock file and unlock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)  # drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None


def lock_save_folder(args, log: Callable = print) -> Optional[SaveLock]:
    """Rank 0 locks ``--save`` before anything is written (None without --save or on other
    ranks). Collective under torch.distributed: every rank raises ``SaveFolderLocked`` with rank
    0's message when the folder is held, so no rank goes on alone."""
    import torch.distributed as dist  # noqa: PLC0415

    if not getattr(args, "save", None):
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    lock, error = None, None
    if rank == 0:
        try:
            lock = SaveLock(args.save).acquire(log)
        except SaveFolderLocked as e:
            error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error is not None:
        raise SaveFolderLocked(error)
    return lock
