"""The command line's jobs over HDF5 files: :mod:`.run` (the run job, one linear body: inspect, plan,
create the output, read, passes, write, publish, verify), :mod:`.safety` (temporary files, locks,
``clean``, signals), :mod:`.verify` (the sampled check of a result), :mod:`.report` (the summary line,
``--json`` and the output's attributes), :mod:`.progress` (progress lines) and :mod:`.selfcheck`
(``burst-hpc check``).
"""
