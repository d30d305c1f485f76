"""``specdecode bench``: a Spec-Bench-style harness (Xia et al., ACL Findings 2024).

Same models, same prompts, every method interleaved per prompt; metrics defined in
:mod:`specdecode.bench.metrics`.

- :mod:`~specdecode.bench.prompts`: Spec-Bench jsonl and HumanEval prompts, category groups.
- :mod:`~specdecode.bench.methods`: the method registry (``target``, our proposers, HF peers).
- :mod:`~specdecode.bench.runner`: the timed loop and ``results.json``.
- :mod:`~specdecode.bench.metrics`: pure aggregation of per-prompt records.
- :mod:`~specdecode.bench.report`: the Markdown tables and PNG plots.
- pricing recorded passes with a cost table (``--cost-table``): :mod:`specdecode.cost.table`.
- the ``bench`` subcommand: :mod:`specdecode.commands.bench`.
"""
