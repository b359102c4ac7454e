"""Log streams that may go away: a run treats stdout and stderr as disposable.

`python train.py ... 2>&1 | tee run.log` is a common habit, and SLURM's SIGTERM (scancel, preemption, the wall) or a
Ctrl-C reaches tee too: the next write to the dead pipe is a BrokenPipeError. The same family: an ssh hang-up with
the terminal gone (EIO), a stream closed by the launcher (`>&-`: Python then has no sys.stdout), a log file on a
full disk (ENOSPC). None of them may end a run. guard_log_streams() wraps sys.stdout and sys.stderr (and so every
writer that looks them up: print, tqdm, warnings, the logging handlers pointed at them) in a LogStream: the first
write or flush that fails marks the stream lost, points its descriptor at /dev/null (so C-level writers, child
processes and Python's own flush at exit meet no error either), says so once on the other stream, and every later
write is dropped. A stream that blocks instead (a descriptor a launcher, CI runner or ssh left non-blocking, whose
reader is slow: EAGAIN) stays: a LogStream writes straight to its descriptor, unbuffered, and what a write cannot
place now is dropped and counted, never kept in a buffer for a later write or the flush at exit to fail on.
lost_log_streams() names the lost streams and the bytes dropped for the metrics summary. stdlib only.
"""

import errno
import logging
import os
import sys

# the errors that mean "this stream's reader or storage went away"; anything else is a bug and is raised
GONE_ERRNOS = {errno.EPIPE, errno.EIO, errno.ENOSPC, errno.EBADF, errno.ECONNRESET, errno.EDQUOT}
LOST_LOG_STREAMS: list[str] = []  # "stdout (broken pipe)", ...: this process's lost streams, for the metrics summary


class LogStream:
    """A text stream that stops writing, silently and for good, once its reader or storage is gone. Over its own
    descriptor (sys.stdout's is 1) it writes straight to it: what would block is dropped and counted in .dropped."""

    def __init__(self, stream, name, fd, lost_list):
        self.stream, self.name, self.fd, self.lost_list = stream, name, fd, lost_list
        self.lost = None  # why it went away, once it did
        self.dropped = 0  # bytes a write could not place without blocking
        self.direct = descriptor(stream) == fd  # else (a test's capture, a StringIO) through the stream

    def write(self, text):
        if self.lost is None and self.direct:
            data = text.encode(self.stream.encoding, self.stream.errors)  # a text the stream cannot encode is a bug
            try:
                self.count_dropped(write_now(self.fd, data))
            except OSError as error:
                self.went_away(error)
        elif self.lost is None:
            try:
                self.stream.write(text)
            except (OSError, ValueError) as error:
                self.went_away(error)
        return len(text)

    def flush(self):  # a direct stream holds nothing to flush
        if self.lost is None and not self.direct:
            try:
                self.stream.flush()
            except (OSError, ValueError) as error:
                self.went_away(error)

    def count_dropped(self, n_bytes):
        first = n_bytes and not self.dropped
        self.dropped += n_bytes  # before the warning, which may be dropped on a shared pipe and come back here
        if first:
            self.say_on_the_other(
                f"{self.name} would block (a non-blocking descriptor, a slow reader); what cannot be written at once "
                f"is dropped and counted, training goes on"
            )

    def went_away(self, error):
        if isinstance(error, OSError) and error.errno not in GONE_ERRNOS:
            raise error
        why = error.strerror if isinstance(error, OSError) and error.strerror else "closed"
        self.lost = why.lower()
        self.lost_list.append(f"{self.name} ({self.lost})")
        silence_fd(self.fd)
        try:  # the buffered text goes to /dev/null now, not to an error at exit
            self.stream.flush()
        except (OSError, ValueError):
            pass
        self.say_on_the_other(f"{self.name} went away ({self.lost}); writing to it stops here, training goes on")

    def say_on_the_other(self, warning):
        other = sys.stderr if self.name == "stdout" else sys.stdout
        if isinstance(other, LogStream) and other is not self:
            other.write(f"warning: {warning}\n")
            other.flush()

    def isatty(self):
        try:
            return self.lost is None and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self):
        return self.fd

    def __getattr__(self, name):  # encoding, errors, buffer, ...: the wrapped stream's
        return getattr(self.stream, name)


def descriptor(stream):
    try:
        return stream.fileno()
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both
        return None


def write_now(fd, data):
    """Write data to fd as far as fd takes it without blocking: returns the count of bytes left unwritten."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            return len(view)
    return 0


def silence_fd(fd):
    """Point descriptor fd at /dev/null: writes to it then succeed and go nowhere."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)


def fd_is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def lost_log_streams():
    """The streams this process lost, with why, and those that dropped writes that would block, with how many
    bytes: [] when both stayed whole."""
    slow = [s for s in (sys.stdout, sys.stderr) if isinstance(s, LogStream) and s.dropped]
    return [*LOST_LOG_STREAMS, *(f"{s.name} ({s.dropped:,} bytes dropped: would block)" for s in slow)]


def guard_log_streams(lost_list=LOST_LOG_STREAMS):
    """Wrap sys.stdout and sys.stderr in LogStreams recording lost ones in lost_list; a stream closed at start
    (`>&-`) counts as lost, and its descriptor is pointed at /dev/null first, so no file this run opens (a
    checkpoint, the metrics) can take descriptor 0, 1 or 2 and receive another writer's text. Idempotent."""
    for fd in (0, 1, 2):
        if not fd_is_open(fd):
            silence_fd(fd)
            if fd:
                lost_list.append(f"{('stdout', 'stderr')[fd - 1]} (closed at start)")
    wrapped = {}
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if isinstance(stream, LogStream):
            continue
        if stream is None:  # closed at start: a stream on /dev/null, already lost
            stream = open(os.devnull, "w")
        try:  # what was written before goes first; a LogStream over the descriptor keeps nothing back
            stream.flush()
        except (OSError, ValueError):
            pass
        guard = LogStream(stream, name, fd, lost_list)
        if any(entry.startswith(f"{name} (closed") for entry in lost_list):
            guard.lost = "closed at start"
        wrapped[stream] = guard
        setattr(sys, name, guard)
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):  # torch's handlers hold the streams of import time
            if isinstance(handler, logging.StreamHandler) and handler.stream in wrapped:
                handler.stream = wrapped[handler.stream]
    return lost_list
