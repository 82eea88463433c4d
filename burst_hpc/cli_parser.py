"""The ``burst-hpc`` command line's text: one parser per verb, its options and their help (the verbs
themselves are in :mod:`burst_hpc.cli`)."""
import argparse
import textwrap

from . import __version__
from .cli_arguments import (dtype_argument, kernel_dtype_argument, nonnegative_float, nonnegative_int,
                            parse_window, positive_float, positive_int, window_size)
from .cli_delivery import Parser
from .dtypes import SPELLINGS

VERBS = ("info", "gen", "run", "verify", "plan", "check", "compile", "clean")

FILE_FORMAT = """\
HDF5 files (gen writes them; any tool can):
  inputs   q (B, S, Hq, D), k and v (B, S, Hkv, D), do (B, S, Hq, D) for --backward; one dtype for all
           cu_seqlens (N+1,) integers, optional: document offsets [0, ..., S] of packed documents (no
           attention across them), the same for every batch entry ('gen --documents N' writes one)
  outputs  o (B, S, Hq, D) and, with --backward, dq (B, S, Hq, D), dk and dv (B, S, Hkv, D), all in the
           input dtype; lse (B, Hq, S) float32, the natural-log sum-exp of each row's scaled scores
  B batch, S tokens in global order (whatever --layout a run uses), Hq query heads, Hkv key/value
  heads (Hq a multiple of Hkv: GQA/MQA), D head dim. Query head h reads key/value head h // (Hq/Hkv).
  dtypes: float16, float32, float64 stored natively; bfloat16 stored as uint16 bits with the dataset
  attribute dtype = "bfloat16" (from NumPy: x.astype(ml_dtypes.bfloat16).view(numpy.uint16)).
  Head dims: any. On the cuda backend 64 and 128 run natively, and on Hopper (sm90) 256 as well;
  any other D is zero-padded to the next of those (exact), wider heads (above 256 on Hopper, above
  128 on other GPUs) run on tiled float32 cuBLAS products (exact, slower than the fused kernels).
"""

EXIT_CODES = """\
exit status: 0 done; 1 bad input or a failed run (one "burst-hpc: error:" line from rank 0, every
rank exits 1, no output file appears); 2 bad command line; 3 --verify found a mismatch (OUT.h5 is
written, its attribute verify = "fail"); 128+N stopped by signal N (143 SIGTERM, a time limit; 130
SIGINT): no output, or with --verify once the passes are done, OUT.h5 written and complete with
verify = "not finished". See the outcome with: h5dump -a verify OUT.h5.
"""


def _wrap(text):
    """``text`` (a paragraph, written across lines) filled to 100 columns."""
    return textwrap.fill(" ".join(text.split()), 100)


def _verb(sub, name, **kwargs):
    """The sub-parser of one verb (descriptions pre-wrapped, epilogs kept as written)."""
    parser = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    parser.set_defaults(spellings=parser.spellings)
    return parser


def build_parser():
    """The parser of the command line: one sub-parser per verb (its name in ``command``)."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = Parser(prog="burst-hpc", formatter_class=raw,
                     description=_wrap("""
Exact attention over sequences split across MPI ranks (BurstAttention ring): one GPU (or one CPU
process) per rank, HDF5 in and out."""),
                     epilog="Run 'burst-hpc COMMAND --help' for each command's options, the HDF5 layout and "
                     "the exit status.\nTypical job:\n"
                     "  burst-hpc gen in.h5 --seqlen 65536 --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 "
                     "--with-grad\n"
                     "  mpiexec -n 8 burst-hpc run in.h5 out.h5 --causal --backward --verify\n"
                     "  mpiexec -n 8 burst-hpc check      # self-test of the kernels and the ring on this machine")
    parser.add_argument("--version", action="version", version=f"burst-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(VERBS) + "}",
                                parser_class=Parser)
    sub.required = True
    for add in (_add_info, _add_gen, _add_run, _add_verify, _add_plan, _add_check, _add_compile, _add_clean):
        add(sub)
    return parser


def _add_info(sub):
    _verb(sub, "info", help="versions, GPUs, MPI library, CUDA-awareness, NCCL, transport choice",
                       description=_wrap("""
Print versions (burst-hpc, Python, NumPy, mpi4py, h5py/HDF5 and whether it has parallel HDF5), the MPI
library, ranks and hosts, whether the MPI is CUDA-aware (BURST_HPC_CUDA_AWARE=1/0 overrides), CuPy and
the GPUs, NCCL, and what --transport auto and --backend auto pick. Run it under mpiexec to see the job's
view. Without a usable MPI library it says what is missing and how to get one."""))


def _add_gen(sub):
    p = _verb(sub, "gen", help="write random inputs q, k, v (and do) to an HDF5 file, chunk by chunk",
                       epilog=FILE_FORMAT,
                       description=_wrap("""
Write standard-normal q, k, v (and do) to OUT.h5 for 'burst-hpc run'. Written in blocks (about 4M values
in memory at a time), so a million-token input never needs a whole tensor in memory. Run it as one
process (under mpiexec rank 0 writes, the others wait). The file appears under its name only when
complete."""))
    p.add_argument("output", metavar="OUT.h5", help="HDF5 file to create (refused if it exists, unless --overwrite)")
    p.add_argument("--batch", type=positive_int, default=1, help="B, sequences in the batch (default 1)")
    p.add_argument("--seqlen", type=positive_int, required=True, help="S, tokens per sequence (required)")
    p.add_argument("--heads", type=positive_int, default=8, help="Hq, query heads (default 8)")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="Hkv, key/value heads; Hq must be a multiple (GQA/MQA) (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="D, the head dimension (default 64)")
    p.add_argument("--dtype", type=dtype_argument, default="bfloat16",
                   help=f"element type of every dataset: {SPELLINGS} (default bfloat16)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="random seed, >= 0; each block of 1024 tokens of one batch entry of one tensor draws from its "
                   "own generator seeded by (seed, tensor, batch, block), so the data never depends on chunk "
                   "sizes (default 0)")
    p.add_argument("--with-grad", action="store_true", help="also write do, the output gradient 'run --backward' needs")
    p.add_argument("--documents", type=positive_int, default=None, metavar="N",
                   help="also write cu_seqlens: N packed documents of random lengths, seeded by --seed (run masks "
                   "attention across them)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT.h5 if it exists (atomically, when done)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _add_run(sub):
    from .plan.layout import LAYOUTS
    from .plan.schemes import SCHEMES
    from .transport import TRANSPORTS

    p = _verb(sub, "run", help="attention over the ranks of mpiexec; outputs written to OUT.h5",
                       epilog=FILE_FORMAT + "\n" + EXIT_CODES,
                       description=_wrap("""
Under 'mpiexec -n P': read q, k, v (and do) from IN.h5, each rank only its own tokens, run the forward
pass (and the backward pass) over the ring of ranks and write o, lse (and dq, dk, dv) to OUT.h5, each
rank only its own token ranges. OUT.h5 is built under a temporary name next to it and appears only when
every rank has finished. Inputs holding NaN or Inf are refused before any work (the error names the
dataset and the first bad index), and so are values large enough to overflow the kernels' float32 sums
(the error names the datasets and their largest magnitudes). Rank 0 prints one summary line: sizes,
ranks, layout, backend, transport, time and TFLOP/s per pass (FlashAttention convention), with --verify
max error / tolerance per output, and the wall seconds of each phase (read, setup, forward, backward,
write, verify, total; set-up: the backend's start, the plan, a rehearsal of the passes that loads their
kernels, connects the communicators and allocates their buffers, and --warmup)."""))
    p.add_argument("input", metavar="IN.h5", help="HDF5 file with q, k, v (and do for --backward); layout below")
    p.add_argument("output", metavar="OUT.h5", help="HDF5 file to write: o, lse (and dq, dk, dv); refused if it exists, "
                   "unless --overwrite")
    p.add_argument("--causal", action="store_true", help="causal mask on global token positions (key j visible "
                   "from query i when j <= i)")
    p.add_argument("--window", type=parse_window, default=None, metavar="L[,R]",
                   help="sliding window: keys at most L before and R after each query (R default 0; -1 unbounded: "
                   "write --window=-1,R); composes with --causal and the input's cu_seqlens")
    p.add_argument("--backward", action="store_true",
                   help="also compute dq, dk, dv, the gradients of sum(do * o); needs do in the input")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="which tokens each rank owns: contiguous (rank r: chunk r of P; S a multiple of P) or "
                   "zigzag (rank r: chunks r and 2P-1-r of 2P, balanced causal work; S a multiple of 2P) or "
                   "balanced (contiguous ownership in natural token order, the visible work of causal, documents "
                   "and windows balanced by ranks computing pieces of block pairs for each other; S a multiple "
                   "of P) or chunks (chunks of tokens placed by the mask so every rank's visible work is equal, "
                   "documents kept on one rank where that costs no balance) (default: the one the cost model "
                   "predicts fastest for this job with the --scheme named, as 'burst-hpc plan' shows it; the job "
                   "shards the file itself)")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="how shards travel between ranks: host (NumPy over MPI), mpi (GPU buffers to a CUDA-aware "
                   "MPI), nccl, staged (GPU -> pinned host -> MPI); auto: host for numpy, else nccl with one GPU a "
                   "rank, else mpi when the MPI is CUDA-aware, else staged ('burst-hpc info' shows the pick) "
                   "(default auto)")
    p.add_argument("--scheme", choices=SCHEMES, default="auto",
                   help="how shards cross nodes: ring (flat), double_ring (inner ring per node, one transfer per "
                   "rank and inner round over the network), ulysses_ring (all-to-all over heads inside the node, "
                   "ring between nodes), gather (each rank receives only the keys its queries see); auto: gather "
                   "with --layout chunks (where it fits) and on one rank, else ring on one node, else the cost "
                   "model's pick ('burst-hpc plan' shows it) (default auto)")
    p.add_argument("--ranks-per-node", type=positive_int, default=None, metavar="W",
                   help="treat every W ranks of a host as one node (emulation; default: detect, or "
                   "BURST_HPC_RANKS_PER_NODE)")
    p.add_argument("--backward-ring", choices=("auto", "q", "kv"), default="auto",
                   help="what travels in the backward pass: q (q, do, dq: BurstAttention) or kv (k, v, dk, dv: "
                   "RingAttention); auto picks the one that moves fewer bytes (default auto)")
    p.add_argument("--backend", choices=("auto", "numpy", "cuda"), default="auto",
                   help="numpy (CPU), or cuda (shards moved to the GPU with CuPy, one GPU per rank: node-local "
                   "rank mod GPU count); auto: cuda when a GPU is visible (default auto)")
    p.add_argument("--scale", type=positive_float, default=None, help="softmax scale, a finite number > 0 (default head_dim**-0.5)")
    p.add_argument("--verify", action="store_true",
                   help="check every output against the float64 oracle on the shards the job holds (a cuda run's "
                   "on its GPUs, or on host copies with BURST_HPC_VERIFY_ON_GPU=0): max error <= 2x (o, lse) / 3x "
                   "(dq, dk, dv) the error of a plain "
                   "same-precision computation plus a small floor; NaN or Inf where the oracle has none fails. "
                   "OUT.h5 is published first; the outcome goes into its attributes (verify = pass, fail, or 'not "
                   "finished' when stopped), a mismatch exits 3. Every token when B*Hq*S^2 <= 4M, else sampled "
                   "tokens of each rank, each checked as a query row (o, lse, dq against every key) and as a key "
                   "column (dk, dv against every query); the predicted cost is printed first. To check later "
                   "instead: burst-hpc verify IN.h5 OUT.h5")
    p.add_argument("--verify-rows", type=positive_int, default=None,
                   help="tokens per rank --verify samples, > 0 (default: as many as cost at most half the passes' "
                   "time on the CPU, 8%% on a GPU, between 16 and 256)")
    p.add_argument("--verify-seed", type=nonnegative_int, default=0,
                   help="where the sampled rows fall, >= 0 (default 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT.h5 if it exists (atomically, once the run has finished); without it an existing "
                   "OUT.h5 is an error before any work and is left untouched")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="run on inputs holding NaN or Inf: they propagate into the outputs of the rows that see them "
                   "(the summary counts them: nonfinite o=N ...; --verify passes NaN and Inf only where the float64 "
                   "oracle has them too); or on values large enough to overflow the kernels' float32 sums")
    p.add_argument("--warmup", action="store_true",
                   help="run the passes once more in the set-up before the timed ones (the set-up already loads "
                   "what the passes use; this also warms clocks and caches)")
    p.add_argument("--progress", action="store_true", help="show stage lines on stderr even on short runs (they show "
                   "anyway on long runs or a terminal): each stage, and inside a pass a line every 5 seconds "
                   "(BURST_HPC_PROGRESS_SECONDS) with the share of rank 0's visible (query, key) pairs done and "
                   "the ETA")
    p.add_argument("--quiet", action="store_true", help="no stage lines")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the run's report to FILE as one JSON object: seconds of read, setup, forward, "
                   "backward, write, verify and total, TFLOP/s, sizes, layout, scheme, transport, backend, device, "
                   "versions (the summary line's facts; OUT.h5's attributes hold them too). Checked before any "
                   "work; an existing FILE is replaced")


def _add_verify(sub):
    p = _verb(sub, "verify",
              help="check a published output against the float64 oracle, on any number of ranks",
              epilog="exit status: 0 the output passed; 3 it failed (the error names each output that failed); 1 the "
              "check could not run.\nexample: mpiexec -n 4 burst-hpc verify in.h5 out.h5",
              description=_wrap("""
Check OUT.h5, written by 'burst-hpc run' from IN.h5 (or any program writing the same datasets), as
--verify does, so a job can publish first and verify later, with any number of ranks: each reads its
share of the tokens once. Sampled tokens of each rank are checked as query rows (o, lse, dq against
every key) and key columns (dk, dv against every query) in float64; every token when B*Hq*S^2 <= 4M. The
mask, gradients and scale default to what OUT.h5 records; flags given must agree with it. An OUT.h5 that
records no mask (written by another program) is refused unless --causal or --no-causal says it. Prints
the predicted cost first, then one line: PASS or FAIL, max error / tolerance per output. OUT.h5 is only
read."""))
    p.add_argument("input", metavar="IN.h5", help="the input the output was computed from")
    p.add_argument("output", metavar="OUT.h5", help="the output to check: o, lse (and dq, dk, dv)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal mask or not (default: as OUT.h5 records; an output that records no mask is refused "
                   "unless one of the two is given)")
    p.add_argument("--window", type=parse_window, default=None, metavar="L[,R]",
                   help="sliding window, as for run (default: as OUT.h5 records; none for an output that records no "
                   "mask)")
    p.add_argument("--scale", type=positive_float, default=None,
                   help="softmax scale, a finite number > 0 (default: as OUT.h5 records, else head_dim**-0.5)")
    p.add_argument("--backward", action="store_true", default=None,
                   help="check dq, dk, dv too (default: when OUT.h5 holds them)")
    p.add_argument("--rows", type=positive_int, default=256, help="tokens per rank sampled, > 0 (default 256)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="where the samples fall, >= 0 (default 0)")
    p.add_argument("--backend", choices=("auto", "numpy", "cuda"), default="auto",
                   help="where to check: numpy (CPU) or cuda (this rank's GPU, float64); auto (the default): the "
                   "GPU when this rank sees one (at S = 131072 on an H100: 7.6 s against 71 s on the CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _add_plan(sub):
    from .plan.rates import GPU_RATES
    from .plan.layout import LAYOUTS

    p = _verb(sub, "plan", help="predicted time of each layout and scheme for a problem and a cluster",
                       description=_wrap("""
The cost model's table (docs/RING.md, 'Across nodes'): for each layout (contiguous, zigzag, balanced)
and scheme (ring, double_ring, ulysses_ring) the predicted forward and forward+backward time, the
communication left exposed, the steps, the critical path over the mean work, TFLOP/s per GPU, bytes per
GPU over the network, peak memory per rank, and the fewest tokens per GPU at which it hides its
communication, all from one step-by-step model of the schedules; the pick is the fastest row
(burst_hpc.choose_layout names its layout; scheme='auto' runs its scheme in it). Rates: the built-in
table of --gpu (its fixed costs as 'burst-hpc compile' measured them on this machine, where it did) with
any of them overridden, or --measure under mpiexec (one kernel timing, one exchange over each link class,
the fixed costs). Fixed costs: each block call, each ring step and each message pays one; the column
'fixed costs' is what they add to the predicted time."""),
                       epilog="example: burst-hpc plan --seqlen 1048576 --heads 32 --kv-heads 8 --causal --nodes 32 "
                       "--gpus-per-node 8 --gpu H100 --inter-gbps 50")
    p.add_argument("--seqlen", type=positive_int, required=True, help="S, tokens in the whole sequence (required)")
    p.add_argument("--batch", type=positive_int, default=1, help="B (default 1)")
    p.add_argument("--heads", type=positive_int, default=32, help="Hq (default 32)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="Hkv (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="D (default 128)")
    p.add_argument("--dtype", type=dtype_argument, default="bfloat16",
                   help=f"element type: {SPELLINGS} (default bfloat16)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--window", type=window_size, default=None, metavar="L",
                   help="causal sliding window of L keys before each query (the visible share follows; -1 none)")
    p.add_argument("--documents", type=positive_int, default=None, metavar="N",
                   help="N packed documents (lengths: --doc-lengths)")
    p.add_argument("--doc-lengths", choices=("equal", "uniform", "lognormal"), default="equal",
                   help="the lengths of --documents: equal, cut at uniform random places, or lognormal "
                   "(long-tailed), drawn from --seed (default equal)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of --doc-lengths (default 0)")
    p.add_argument("--cu-seqlens", default=None, metavar="FILE",
                   help="real document offsets [0, ..., S]: a text or .npy file, or an HDF5 input holding cu_seqlens")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="only this layout's rows (default: every layout's; the pick is the fastest row)")
    p.add_argument("--nodes", type=positive_int, default=None, help="nodes (default 1; with --measure: the job's)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, help="ranks per node (default 8; with --measure: "
                   "the job's)")
    p.add_argument("--gpu", choices=sorted(GPU_RATES), default="H100", help="built-in rates (default H100)")
    for name, unit, kind in (("fwd-tflops", "forward kernels' price: per visible pair at this TFLOP/s, not per tile",
                              positive_float),
                             ("bwd-tflops", "backward kernels' price: per visible pair at this TFLOP/s (pre-pass and dq conversion "
                              "included), not per tile",
                              positive_float),
                             ("intra-gbps", "GB/s per GPU inside a node", positive_float),
                             ("inter-gbps", "GB/s per GPU between nodes", positive_float),
                             ("intra-latency-us", "fixed cost of a message inside a node (us)", nonnegative_float),
                             ("inter-latency-us", "fixed cost of a message between nodes (us)", nonnegative_float),
                             ("fwd-launch-us", "fixed cost of a forward block call (us)", nonnegative_float),
                             ("bwd-launch-us", "fixed cost of a backward block call (us)", nonnegative_float),
                             ("step-us", "fixed cost of a ring step (us)", nonnegative_float)):
        p.add_argument(f"--{name}", type=kind, default=None, help=f"override the {unit}")
    p.add_argument("--measure", action="store_true", help="measure the rates here, under mpiexec")
    p.add_argument("--ranks-per-node", type=positive_int, default=None, metavar="W",
                   help="with --measure: treat every W ranks of a host as one node")


def _add_check(sub):
    p = _verb(sub, "check", help="self-test: kernels and ring against the float64 oracle, pass/fail table",
                       description=_wrap("""
Correctness self-test of this installation, in seconds. On a GPU: every kernel family the GPU runs,
forward and backward, on odd shapes (lengths off the tile, GQA, causal and not, bfloat16 and float16,
padded head dims); without a GPU the NumPy backend, and it says so. Under 'mpiexec -n P' (P > 1) also
the ring over every transport 'burst-hpc info' lists as available. Each result must meet the
FlashAttention rule against the float64 oracle (as --verify). Prints a pass/fail table on rank 0."""),
                       epilog="exit status: 0 every check passed; 3 a check failed; 1 the check could not run.")
    p.add_argument("--seed", type=nonnegative_int, default=None,
                   help="draw the inputs from this seed, >= 0 (the table's header prints the seed of every run, so a "
                   "failure can be replayed) (default: a fresh seed)")


def _add_compile(sub):
    from .transport import TRANSPORTS

    p = _verb(sub, "compile", help="compile kernels into the cache ahead of jobs (job prologue, image build)",
              description=_wrap("""
Compile the CUDA kernels of the chosen families, head dims and dtypes (every mask, forward and backward)
into the kernel cache that jobs with the same CUPY_CACHE_DIR read, so their first calls compile nothing
('burst-hpc info' lists what the cache holds; a job with BURST_HPC_NO_JIT=1 refuses to compile). Runs on
a GPU node of the kind the jobs use; under 'mpiexec -n P' the ranks of a node share the compiles out.
Each kernel is compiled once per cache directory, whatever number of processes or jobs share it. Then it
measures the cost model's fixed costs here (a block call's launch, a ring step, a message between ranks 0
and 1 under mpiexec) and keeps them beside the kernels (fixed-costs-MODEL-VERSION.json), where
burst_hpc.choose_layout, scheme='auto' and 'burst-hpc plan --gpu MODEL' read them."""))
    p.add_argument("--family", action="append", choices=("sm90", "sm80"),
                   help="a kernel family, repeatable (default: those this GPU runs)")
    p.add_argument("--head-dim", action="append", type=positive_int, metavar="D",
                   help="a head dim, repeatable (default: every one the kernels run natively)")
    p.add_argument("--dtype", action="append", type=kernel_dtype_argument,
                   help=f"an input dtype the kernels run, repeatable: {SPELLINGS}, but float64; float32 runs the "
                   "bfloat16 kernels (default: bfloat16 and float16)")
    p.add_argument("--pass", dest="passes", action="append", choices=("fwd", "bwd"),
                   help="forward or backward kernels only (default: both)")
    p.add_argument("--backend", choices=("cuda", "numpy"), default="cuda",
                   help="cuda (the default): compile the kernels, then measure the cost model's fixed costs on "
                   "this GPU; numpy: compile nothing, measure the CPU path's fixed costs")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="the transport whose message latency and step cost are measured (default auto)")
    p.add_argument("--tile-prices", action="store_true",
                   help="measure the kernels' prices per tile too (cuda: six calls on packed documents and "
                   "plain causal, forward and backward, a few seconds), kept with the fixed costs; without it "
                   "the built-in prices of this GPU model stay")


def _add_clean(sub):
    p = _verb(sub, "clean", help="remove temporary files a killed job left next to an output",
                       description=_wrap("""
A job killed from outside (SIGKILL, a node failure) can leave OUT.h5.tmp-<host>-<pid>-<tag> (and its
lock file, the same name + .lock) next to OUT.h5. The job writing such a file holds a lock on its lock
file for as long as it runs, whatever program it is (burst-hpc, or a script using
burst_hpc.io.OutputFile). clean lists the files and removes those whose lock nobody holds (written on
this host). A running job's file is never removed. A file written on another host is listed and kept,
since a lock held there is not always visible here (it depends on the file system and its mount);
--force removes it, and files without a lock file, once you know no job writes OUT.h5."""))
    p.add_argument("output", metavar="OUT.h5", help="the output whose temporary files to look for")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--force", action="store_true",
                   help="also remove the files whose job this host cannot judge (another host's; none with a "
                   "lock file held, which is never removed)")

