"""The ring engine, which runs a plan on arrays: :mod:`.ring` (the one step loop for every schedule),
:mod:`.passes` (the forward and backward passes: the ring, or the ring wrapped in Ulysses' all-to-alls
over heads), :mod:`.ulysses` (those all-to-alls) and :mod:`.merge` (the online-softmax merge of
partial outputs).
"""
