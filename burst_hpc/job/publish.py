"""Publishing a finished temporary output under its name without replacing a file that appeared there
meanwhile (another job's): a hard link, or renameat2 with RENAME_NOREPLACE, both atomic."""
import ctypes
import errno
import os
import uuid

from ..errors import FileError
from .owner import TEMP_NAME

RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _renameat2_noreplace(src, dst):
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), dst)


def link_noreplace(src, dst):
    """Give ``src`` the name ``dst`` (and drop ``src``) unless ``dst`` exists: FileExistsError
    then, and ``src`` stays. A hard link where the file system has them, else renameat2 with
    RENAME_NOREPLACE; both are atomic, so of two racing callers exactly one wins."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS, errno.EACCES):
            raise
        try:
            _renameat2_noreplace(src, dst)
        except FileExistsError:
            raise
        except OSError as e2:
            if e2.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise FileError(f"this file system offers neither hard links nor RENAME_NOREPLACE, so "
                                f"{dst!r} cannot be created without risk of replacing another job's file; "
                                "pass --overwrite to publish by a plain rename") from None
            raise
        return
    os.unlink(src)


def kept_name(final, tmp):
    """Where a job that lost the race for ``final`` keeps its result: OUT.kept-<tag>.h5."""
    root, ext = os.path.splitext(os.path.abspath(final))
    m = TEMP_NAME.search(tmp)
    tag = f"{m['pid']}-{m['tag']}" if m else uuid.uuid4().hex[:8]
    return f"{root}.kept-{tag}{ext}"


def publish(tmp, final, overwrite=False):
    """Move the finished temporary file ``tmp`` to ``final``. With ``overwrite`` an existing file is
    replaced (atomically); without it a file that appeared at ``final`` meanwhile is never
    replaced: this job's result is moved to :func:`kept_name` and a FileError says where."""
    if overwrite:
        os.replace(tmp, final)
        return
    try:
        link_noreplace(tmp, final)
        return
    except FileExistsError:
        pass
    kept = kept_name(final, tmp)
    try:
        link_noreplace(tmp, kept)
    except OSError:
        kept = tmp
    error = FileError(f"output {final!r} appeared while this job ran (another job wrote it) and was not "
                      f"replaced; this job's complete result is kept as {kept!r} (rename it, or rerun with --overwrite)")
    error.kept = kept
    raise error
