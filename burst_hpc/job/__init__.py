"""The command line's jobs over HDF5 files: :mod:`.run` (the run job, one linear body: inspect, plan,
create the output, read, passes, write, publish, verify), :mod:`.owner` (temporary files and
the lock their writer holds), :mod:`.publish` (never replacing another job's file), :mod:`.leftovers`
(``clean``), :mod:`.safety` (signals, HDF5 failures), :mod:`.verify` (the sampled check of a result,
with :mod:`.verify_sums`, :mod:`.verify_cost` and :mod:`.verify_warm`), :mod:`.report` (the summary line,
``--json`` and the output's attributes), :mod:`.progress` (progress lines) and :mod:`.selfcheck`
(``burst-hpc check``).
"""
