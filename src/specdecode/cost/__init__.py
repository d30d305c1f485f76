"""Pricing: what a pass costs on a machine, measured, tabled and used.

Two consumers, one home:

- ``specdecode bench --cost-table`` prices the passes a bench run recorded with a table of
  milliseconds per pass measured elsewhere (exact decoding makes the same passes on every machine):
  :mod:`~specdecode.cost.table` (the JSON format, :class:`~specdecode.cost.table.CostCurve`,
  pricing and predicted speedups; the packaged tables under ``specdecode/data/cost_tables``), and
  :mod:`~specdecode.cost.measure` (measuring such a table here: ``specdecode cost-table``).
- ``specdecode serve --speculation adaptive`` decides each step how many tokens each sequence
  drafts from a cost model measured at start-up: :mod:`~specdecode.cost.serve_model` (the model,
  the per-sequence acceptance estimate and the per-step plan), :mod:`~specdecode.cost.serve_measure`
  (the start-up measurement) and :mod:`~specdecode.cost.cache` (that measurement kept on disk, so a
  restart reuses it).

The engine's draft gate reads pass costs measured while decoding instead
(:class:`specdecode.draft_gate.PassCosts`). Importing this package imports nothing.
"""
