"""HDF5 in and out, each MPI rank touching only its own tokens.

- :mod:`.format`: dataset names, dtypes as stored and read back, chunks, slabs, the format stamp;
- :mod:`.read`: :class:`InputSpec`, :func:`inspect_input`, :func:`read_shards`, the value checks,
  :func:`read_global`;
- :mod:`.output`: :class:`OutputFile` (create, write, commit, abort), the output path and space
  checks, :func:`write_new` and :func:`write_global` for one process;
- :mod:`.generate`: ``burst-hpc gen``'s random inputs.

The names below are the package's API: ``from burst_hpc import io; io.read_shards(...)``.
"""
from .format import (CHUNK_BYTES, FORMAT, GRADS, INPUTS, TOKEN_AXIS, chunk_shape, create_dataset, dataset_dtype,
                     fixed_text, from_stored, modify_attrs, read_slab, stamp, stored_dtype, to_stored, write_slab)
from .generate import GEN_BLOCK_TOKENS, generate
from .output import (WRITE_OPTS, OutputFile, bytes_needed, check_output_path, check_space, output_datasets,
                     write_global, write_new, write_path)
from .read import (RANGE_HEADROOM, InputSpec, check_finite, check_range, inspect_input, largest_magnitudes,
                   open_input, read_global, read_shards, read_tokens)

__all__ = ["CHUNK_BYTES", "FORMAT", "GRADS", "INPUTS", "TOKEN_AXIS", "chunk_shape", "create_dataset", "dataset_dtype",
           "fixed_text", "from_stored", "modify_attrs", "read_slab", "stamp", "stored_dtype", "to_stored", "write_slab",
           "GEN_BLOCK_TOKENS", "generate",
           "WRITE_OPTS", "OutputFile", "bytes_needed", "check_output_path", "check_space", "output_datasets",
           "write_global", "write_new", "write_path",
           "RANGE_HEADROOM", "InputSpec", "check_finite", "check_range", "inspect_input", "largest_magnitudes",
           "open_input", "read_global", "read_shards", "read_tokens"]
