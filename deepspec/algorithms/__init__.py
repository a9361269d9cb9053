"""Drafting algorithms, one folder each (``dspark/``: DSpark and DFlash; ``eagle3/``; ``ngram/``: the
training-free baseline), the protocols they implement (:mod:`.protocol`) and the registry (:mod:`.registry`)."""
