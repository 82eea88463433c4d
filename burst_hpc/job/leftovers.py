"""What a stopped job leaves next to an output: its temporary files, listed for the note a new job
prints (:func:`stale_note`) and removed by ``burst-hpc clean`` when no running job owns them
(:func:`clean`; whose they are: :mod:`.owner`)."""
import contextlib
import os

from ..errors import size_text
from .owner import LOCK_SUFFIX, scan

def temp_files(final):
    """[(path, state, why)] for the temporary files of output ``final`` (lone sidecars included)."""
    entries = scan(final)
    for e in entries:
        e.close()
    return [(e.path or e.lock, e.state, e.why) for e in entries]


def _size(path):
    try:
        return size_text(os.path.getsize(path))
    except OSError:
        return "?"


def stale_note(final):
    """Lines to print before a job writes ``final``: its leftover temporary files, if any."""
    lines = []
    for path, state, why in temp_files(final):
        if state == "live" or path.endswith(LOCK_SUFFIX):
            continue
        how = (f"burst-hpc clean {final}" if state == "stale" else
               f"burst-hpc clean --force {final}  (only once no job writes {final})")
        lines.append(f"burst-hpc: note: temporary file {path} ({_size(path)}) is left from an earlier job "
                     f"({why}); remove it with: {how}")
    return lines


def clean(final, dry_run=False, force=False):
    """Remove the stale temporary files of ``final`` (and with ``force`` those of other hosts or
    without a lock file); return report lines. A file whose lock is held is never removed."""
    entries = scan(final)
    if not entries:
        return [f"burst-hpc clean: no temporary files of {final}"]
    lines = []
    try:
        for e in entries:
            name = e.path or e.lock
            what = name if e.lone_lock or e.lock is None else f"{name} and its lock file"
            if e.state == "stale" or (force and e.state in ("remote", "unknown")):
                if not dry_run:
                    for path in e.files():  # the temporary file first: its lock guards it until the end
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(path)
                forced = "" if e.state == "stale" else "; --force"
                lines.append(f"{'would remove' if dry_run else 'removed'} {what} ({e.why}{forced})")
            elif e.state == "live":
                lines.append(f"kept {name}: a running job owns it ({e.why})")
            elif e.state == "remote":
                lines.append(f"kept {name}: cannot tell from this host whether its job runs ({e.why}); once no "
                             f"job on host {e.host} writes {final}, remove it with: burst-hpc clean --force {final}")
            else:
                lines.append(f"kept {name}: cannot tell whether its job runs ({e.why}); once no job writes "
                             f"{final}, remove it with: burst-hpc clean --force {final}")
    finally:
        for e in entries:
            e.close()
    return lines
