"""The training-free n-gram (prompt lookup) baseline: :mod:`.proposer` (no model, no loss, no training).

A baseline is a proposer only; its name is registered in :data:`deepspec.algorithms.registry.BASELINES`
and ``deepspec eval`` builds it beside the drafts (:func:`deepspec.decoding.settings.build_proposers`).
"""
