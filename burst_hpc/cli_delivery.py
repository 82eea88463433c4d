"""The command line's exit policy and its one-message delivery across the ranks of a job.

Every rank of a job parses the same command line and runs the same verb with the same options
(:func:`agree_command`, before the verb reads, creates or replaces anything); an error every rank has
alike (a bad command line, an agreed BurstError) is said once, by rank 0, and is out before any rank
exits (:func:`say_once`).
"""
import argparse
import os
import sys
import time

from .collective import agree, launched, live_world, mpi_problem, rank_and_size
from .errors import BurstError, UsageError, say
from .job import safety

EXIT_ERROR, EXIT_USAGE, EXIT_MISMATCH = 1, 2, 3


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line once (rank 0), not once per rank, and surely:
    every rank parses the same command line, so every rank meets rank 0 before it exits. It knows
    how the command line spells each of its arguments (``spellings``: dest -> '--name' or 'IN.h5')."""

    def __init__(self, *args, **kwargs):
        self.spellings = {}   # before argparse's own __init__ adds --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self.spellings[action.dest] = action.option_strings[-1] if action.option_strings else action.metavar
        return action

    def error(self, message):
        def write():
            self.print_usage(sys.stderr)
            say(message)

        try:   # ranks whose command line parsed wait in the command's agreement: meet them there
            agree_command(error=UsageError(message))
        except BurstError:
            pass
        say_once(write)
        sys.exit(EXIT_USAGE)

    def exit(self, status=0, message=None):
        if status == 0:   # --help or --version (a bad command line goes through error)
            try:   # ranks whose command line runs a command wait in its agreement: meet them there
                agree_command({"the command": "--help or --version"})
            except BurstError as e:
                text = str(e)
                say_once(lambda: say(text))
                sys.exit(EXIT_ERROR)
        super().exit(status, message)

    def print_help(self, file=None):
        if rank_and_size()[0] == 0:   # under a launcher: once, from rank 0 (the launcher's rank, no MPI call)
            super().print_help(file)


# how long a rank waits at the end of a job that failed for rank 0 to say why (see say_once)
SAY_WAIT_S = 30.0


def say_once(write):
    """Deliver an error every rank of the job has alike (a bad command line, an agreed BurstError):
    rank 0 calls ``write`` (lines on stderr, flushed), then every rank meets at a barrier, so no
    rank exits, and makes the launcher end the job, before rank 0's lines are out. MPI is
    initialised here if it was not yet (a bad command line is found before any verb runs); where no
    MPI library loads, every rank writes (the same lines P times, never none). A rank that waits
    SAY_WAIT_S without rank 0 at the barrier (ranks started with different command lines) writes
    the lines itself. Afterwards a SIGTERM (the launcher ending ranks still exiting once the first
    has gone) ends this rank without a second error line."""
    comm = job_world()
    if comm is None or comm.rank == 0:
        write()
    if comm is not None and comm.size > 1 and not _meet(comm, SAY_WAIT_S) and comm.rank != 0:
        write()
    safety.error_reported()


def job_world():
    """MPI.COMM_WORLD when MPI is up, or when launched by mpiexec and an MPI library loads (it is
    initialised then); None otherwise (one process, or no usable MPI)."""
    if live_world() is None and launched() and mpi_problem() is None:
        from mpi4py import MPI  # noqa: F401  (initialises MPI)
    return live_world()


def _meet(comm, seconds):
    """A barrier that gives up after ``seconds``: True when every rank came."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


# options that change only what rank 0 prints, so ranks may differ in them; and those naming files
DISPLAY_OPTIONS = ("quiet", "progress")
PATH_OPTIONS = ("input", "output", "json", "cu_seqlens")


def command_signature(args):
    """What every rank of a job must run alike: the command and each of its options (paths made
    absolute: ranks in different directories may name one file differently), by their spelling."""
    signature = {"the command": args.command}
    for dest, spelling in args.spellings.items():
        if hasattr(args, dest) and dest not in DISPLAY_OPTIONS:
            value = getattr(args, dest)
            signature[spelling] = os.path.abspath(value) if dest in PATH_OPTIONS and value is not None else value
    return signature


def agree_command(signature=None, error=None):
    """Collective under a launcher: every rank runs the same command with the same options (``signature``:
    command_signature), or every rank gets one RankMismatchError naming the first that differs, before the
    command reads, creates or replaces anything or meets the others in any other collective. ``error``:
    this rank's command line does not parse; every rank raises it."""
    comm = job_world()
    if comm is not None and comm.size > 1:
        agree(comm, error, signature)
