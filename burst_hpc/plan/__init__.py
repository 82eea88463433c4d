"""What runs where, decided from shapes alone (no arrays): the planning layer.

- :mod:`.decomposition`: ``Decomposition``, a sequence's decomposition over the ranks (the layout,
  topology, scheme, transport and backward ring), built from shapes and agreed by every rank in one
  collective; ``CallPlan``, a decomposition bound to the arrays' backend; :mod:`.decisions`: the
  decisions made from what was agreed;
- :mod:`.callplan`: the plan of a call from its arrays, and the cache of plans;
- :mod:`.layout`: ``Layout``, which global tokens each rank holds (contiguous, zigzag, balanced),
  its pieces, indices, HDF5 slabs, ``shard`` and ``unshard``;
- :mod:`.masks`: causal, documents and windows as intervals of visible keys;
- :mod:`.schedule`: the block pairs each rank runs at each ring step and what it sends to whom;
  :mod:`.balance`: the balanced layout's work dealt to ranks; :mod:`.workload`: the visible work per
  step and rank; :mod:`.schemes` and :mod:`.topology`: the schemes across nodes and the nodes;
- :mod:`.accounting` and :mod:`.costmodel`: bytes, FLOPs and predicted times; :mod:`.rates`: what the
  model prices with (kernel and link rates, the fixed costs per block call, step and message);
  :mod:`.calibrate`: those fixed costs measured here (``burst-hpc compile``); :mod:`.memory`: peak
  memory per rank; :mod:`.tables`: the ``burst-hpc plan`` verb's tables.
"""
