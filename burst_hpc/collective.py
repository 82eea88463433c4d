"""Agreement across ranks: bad input gives the same clear error on every rank, never a hang."""
from . import errors
from .errors import BurstError, RankMismatchError


def describe(error):
    """An exception as one line: the message of our own errors, 'Type: message' for others."""
    return str(error) if isinstance(error, BurstError) else f"{type(error).__name__}: {error}"


def agree(comm, error=None, signature=None):
    """Collective. If any rank has an error, raise the lowest failing rank's on every rank, as
    the same BurstError subclass and with the same text (marked ``agreed = True``). Then, if
    ``signature`` (a dict) differs between ranks, raise RankMismatchError everywhere."""
    mine = None if error is None else (type(error).__name__, describe(error), 0 if comm is None else comm.rank)
    single = comm is None or comm.size == 1
    gathered = [(mine, signature)] if single else comm.allgather((mine, signature))
    failed = [e for e, _ in gathered if e is not None]
    if failed:
        name, message, rank = failed[0]
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, BurstError)):
            cls = BurstError
        if not single and len(failed) < comm.size:
            message = f"{message} (rank {rank})"
        agreed = cls(message)
        agreed.agreed = True
        raise agreed from error
    if signature is not None:
        first = gathered[0][1]
        for rank, (_, theirs) in enumerate(gathered):
            for key in signature:
                if theirs.get(key) != first.get(key):
                    mismatch = RankMismatchError(
                        f"ranks disagree on {key}: rank 0 has {first.get(key)!r}, rank {rank} has "
                        f"{theirs.get(key)!r}; every rank must pass matching arguments")
                    mismatch.agreed = True
                    raise mismatch
