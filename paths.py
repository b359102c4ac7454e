"""The files a run reads and writes, checked before anything is written: an output path that would destroy an input
or land somewhere unexpected, an output another running train.py holds, a validation file that is a copy of a
training file. launch.checked_inputs calls these; a failure is a ValueError or an OSError, one sentence, and leaves
nothing new. Outputs are known by identity (a folder's device and inode, and the name in it), never by the path that
names them, and every output is written as a new file renamed in, never through another name of an existing one.
"""

import dataclasses
import errno
import fcntl
import hashlib
import os
import pwd
import stat

from checkpoint import check_writable, missing_folders, name_max, remove_quietly, unique_sibling
from data import find_token_files


def check_outputs(hp, say):
    """The checkpoint and metrics paths, checked against every way an output can destroy an input or land
    somewhere unexpected; returns hp with a symlinked output replaced by its target (written, and said so). Files
    are compared by identity (device, inode), not by path: a hard link or a bind mount reaches an input too."""
    folder = hp.data_dir or ""
    names = [os.path.join(folder, n) for n in (os.listdir(folder) if os.path.isdir(folder) else [])]
    given = [*names, *([hp.val_file] if hp.val_file else [])]
    inputs = {**{os.path.realpath(p): p for p in given}, **{file_identity(p): p for p in given}}
    inputs.pop(None, None)
    resolved = {}
    for flag in ("checkpoint_path", "metrics_path"):
        path = getattr(hp, flag)
        if not path.strip():
            raise ValueError(f"--{flag} is empty; name a file")
        real = os.path.realpath(path)
        if (key := file_identity(path)) in inputs or (key := real) in inputs:
            raise ValueError(f"--{flag} {path} is the input file {inputs[key]}; writing it would destroy it")
        if os.path.exists(real) and not stat.S_ISREG(os.stat(real).st_mode) and not os.path.isdir(real):
            raise ValueError(f"--{flag} {path} is a device, pipe or socket, not a file a checkpoint can replace")
        if os.path.islink(path):
            say(f"--{flag} {path} is a symlink: writing its target, {real}")
        resolved[flag] = real if os.path.islink(path) else path
        check_writable(resolved[flag], flag)
    checkpoint, metrics = resolved["checkpoint_path"], resolved["metrics_path"]
    same = os.path.realpath(checkpoint) == os.path.realpath(metrics) or place(checkpoint) == place(metrics)
    if same or file_identity(checkpoint) == file_identity(metrics) is not None:
        raise ValueError(
            f"--metrics_path and --checkpoint_path are both {resolved['metrics_path']}; each needs its own file"
        )
    return dataclasses.replace(hp, **resolved)


def file_identity(path):
    """(device, inode) of the file path reaches (through symlinks), or None when there is none: every path to one
    file (a hard link, a symlink, a bind mount) has the same."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def place(path):
    """Where path's file is or will be, by identity: its nearest existing folder's (device, inode) and the names from
    there on. Two paths to one place (a folder reached through a symlink or a bind mount) have the same."""
    folder = os.path.abspath(path)
    rest: list[str] = []
    while (key := file_identity(folder)) is None and folder != os.path.dirname(folder):
        folder, name = os.path.split(folder)
        rest.insert(0, name)
    return key, tuple(rest)


def training_twin(val_file, data_dir, head_bytes=1 << 20):
    """The training file that val_file is (the same file, or a copy: the same size and first MiB), else None."""

    def head(path):
        with open(path, "rb") as file:
            return file.read(head_bytes)

    for path in find_token_files(data_dir):
        same_size = os.path.getsize(path) == os.path.getsize(val_file)
        if os.path.realpath(path) == os.path.realpath(val_file) or (same_size and head(path) == head(val_file)):
            return path
    return None


OUTPUT_LOCKS: list["OutputLock"] = []  # this process's output locks, open for its whole life: closing one releases it
LOCK_TRIES = 5  # a lock file replaced while it was being locked (another run making its own) is opened again


class OutputLock:
    """An exclusive flock held on an output's lock file, through descriptor fd; created: whether this run made the
    file (a refusal then removes it again, still holding the lock, so no other run can hold it meanwhile)."""

    def __init__(self, fd, path, created):
        self.fd, self.path, self.created = fd, path, created

    def close(self, remove=False):
        if self.fd is None:
            return
        if remove and self.created:
            remove_quietly(self.path)
        os.close(self.fd)
        self.fd = None


class PendingFile:
    """A new, empty file under a temporary name beside path, open to append: put_in_place() renames it over path and
    returns it, so another name of the file there before (a hard link, as `cp -al` of a run folder makes) keeps its
    content; close() discards it."""

    def __init__(self, path):
        self.path, self.tmp = path, unique_sibling(path, "tmp")
        self.handle = open(self.tmp, "x")
        PENDING_FILES.append(self)

    def put_in_place(self):
        os.replace(self.tmp, self.path)
        PENDING_FILES.remove(self)
        return self.handle

    def close(self):
        self.handle.close()
        remove_quietly(self.tmp)
        if self in PENDING_FILES:
            PENDING_FILES.remove(self)


PENDING_FILES: list[PendingFile] = []  # the PendingFiles not put in place yet: a refusal discards them


def lock_outputs(hp, say):
    """Own the checkpoint and the metrics file before writing either, and return the metrics file to be (a
    PendingFile): a second train.py on either path (as its checkpoint or its metrics) is refused, one sentence. The
    checkpoint first: once it is ours, another metrics path is a safe way round a metrics file in use. A refusal here
    leaves nothing new (release_outputs)."""
    advice = {
        "checkpoint_path": "wait for it to end, or give this run its own --checkpoint_path and --metrics_path",
        "metrics_path": "give this run its own --metrics_path",
    }
    taken, made, unlockable = [], [], []
    try:
        for flag in ("checkpoint_path", "metrics_path"):
            path = getattr(hp, flag)
            folder = os.path.dirname(os.path.abspath(path))
            made += missing_folders(folder)
            os.makedirs(folder, exist_ok=True)
            lock = take_lock(path, flag, advice[flag])
            if isinstance(lock, str):  # storage without locks: not "in use"
                unlockable.append(f"{path} ({lock})")
            else:
                taken.append(lock)
        metrics = PendingFile(hp.metrics_path)
    except BaseException:
        release_outputs(taken, made)
        raise
    OUTPUT_LOCKS.extend(taken)
    OUTPUT_FOLDERS.extend(made)
    if unlockable:
        say(f"warning: {' and '.join(unlockable)} cannot be locked here; a second run on them would not be refused")
    return metrics


OUTPUT_FOLDERS: list[str] = []  # the folders lock_outputs made for the outputs, outermost first


def release_outputs(locks=None, folders=None):
    """A run refused before the clock: its output locks released, the lock files and folders it made removed (by
    default all of this process's)."""
    locks, folders = OUTPUT_LOCKS if locks is None else locks, OUTPUT_FOLDERS if folders is None else folders
    while PENDING_FILES:
        PENDING_FILES[-1].close()
    while locks:
        locks.pop().close(remove=True)
    remove_quietly(*reversed(folders))
    folders.clear()


def take_lock(path, flag, advice):
    """An OutputLock on path's lock file, or why the storage takes no locks (ENOLCK, ENOSYS: a warning, not a
    refusal). Raises ValueError, one sentence, for an output another running train.py holds or a lock file that
    cannot be one. The file locked is the one the name leads to after the lock is taken (a lock file replaced
    meanwhile is opened again), and has no other name: one made by a hard link (a `cp -al` copy of a running run's
    folder) is replaced by a file of this output's alone."""
    lock = lock_file(path)
    for _ in range(LOCK_TRIES):
        fd, created = open_lock(lock, flag, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            names = os.fstat(fd).st_nlink
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                shared = (
                    f" (or its lock file {lock} is one of {names} names of one file, as `cp -al` of a running run's "
                    f"folder makes, and a run on another name holds it)"
                    if names > 1
                    else ""
                )
                raise ValueError(f"--{flag} {path} is in use by another running train.py{shared}; {advice}") from None
            if e.errno == errno.EBADF:  # opened read-only (another user's file) where locks need write access (NFS)
                raise ValueError(unopenable(flag, path, lock, "it cannot be opened to write")) from None
            if created:  # no lock to hold: no lock file left either
                remove_quietly(lock)
            return e.strerror or str(e)
        held = os.fstat(fd)
        if file_identity(lock) != (held.st_dev, held.st_ino):
            os.close(fd)
            continue
        if held.st_nlink > 1:
            fd, created = own_lock_file(fd, lock), True
        return OutputLock(fd, lock, created)
    raise ValueError(f"--{flag} {path}: its lock file {lock} was replaced {LOCK_TRIES} times while it was locked")


def open_lock(lock, flag, path):
    """(a descriptor of the lock file, whether this made it). Never a FIFO or a device: opening one can block with no
    way out (SIGTERM included) or act on hardware; non-blocking, and checked before and after it is opened. A lock
    file of another user's is opened read-only (a flock needs no more); it is made readable and writable by all, so a
    lock file left behind by a run of this user never stops another user's run."""
    flags = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    not_a_file = f"--{flag} {path}: its lock file {lock} is not a regular file; remove it, or name another output"
    try:
        if not stat.S_ISREG(os.stat(lock).st_mode):
            raise ValueError(not_a_file)
    except FileNotFoundError:
        if os.path.lexists(lock):  # a symlink to nothing
            raise ValueError(not_a_file) from None
    try:
        fd, created = os.open(lock, flags | os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), True
        os.fchmod(fd, 0o666)  # whatever the umask: another user's later run must be able to open it
    except FileExistsError:
        created = False
        try:
            fd = os.open(lock, flags | os.O_RDWR)
        except PermissionError:
            try:
                fd = os.open(lock, flags | os.O_RDONLY)
            except PermissionError as e:
                raise ValueError(unopenable(flag, path, lock, f"it cannot be opened ({e.strerror})")) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(not_a_file)
    return fd, created


def unopenable(flag, path, lock, why):
    """The refusal for a lock file this user cannot lock: whether a run holds it cannot be told."""
    try:
        owner = pwd.getpwuid(os.stat(lock).st_uid).pw_name
    except (OSError, KeyError):
        owner = "another user"
    return (
        f"--{flag} {path}: its lock file {lock} belongs to {owner} and {why}, so whether a running train.py holds it "
        f"cannot be told; if none does, remove it (it holds nothing: only a running train.py's lock on it counts)"
    )


def own_lock_file(fd, lock):
    """A lock file of this output's alone in place of one shared by hard links: a new file, locked, then renamed over
    the name while the shared one is still held, so the output is never unlocked; the descriptor to keep."""
    tmp = unique_sibling(lock, "tmp")
    try:
        new = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError:
        return fd  # the shared file stays locked: a run on its other name is refused, never this output left open
    try:
        os.fchmod(new, 0o666)
        fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(tmp, lock)
    except OSError:
        os.close(new)
        remove_quietly(tmp)
        return fd
    os.close(fd)
    return new


def lock_file(path):
    """The file an output's lock is held on: a hidden sibling (.NAME.lock) in the output's own folder, so every path
    to the output (a symlinked or bind-mounted folder) reaches one lock file, and it stays when the output is replaced
    by a rename (every save), so the lock outlives the saves. A name too long for the file system is cut and given a
    digest of the whole: two outputs whose names share a long prefix never share a lock."""
    folder, name = os.path.split(path)
    room = name_max(os.path.abspath(folder or "."))
    if len(f".{name}.lock".encode()) <= room:
        return os.path.join(folder, f".{name}.lock")
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    head = name.encode()[: room - len(f"..{digest}.lock")].decode(errors="ignore")
    return os.path.join(folder, f".{head}.{digest}.lock")
