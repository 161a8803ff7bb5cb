"""Embedding tables, the parts both sides share: what a table is, and its rows.

- :mod:`psframe.tables.spec`: a table's spec (a dynamic table's row
  initializer, admission and eviction) and where its rows live among the ps tasks;
- :mod:`psframe.tables.rows`: rows as they move between a worker and a ps task;
- :mod:`psframe.tables.dynamic_rows`: the rows of a dynamic table (any int64 id),
  held by a ps task (or by one process training alone: ``psframe.DynamicTables``);
- :mod:`psframe.tables.id_index`: where each id's slot is, found in bulk (a
  dynamic table's part);
- :mod:`psframe.tables.admission`: which new ids a dynamic table gives a row;
- :mod:`psframe.tables.eviction`: which rows a dynamic table part forgets, by their ages;
- :mod:`psframe.tables.change_stamps`: what changed in a dynamic table part's rows
  (for delta checkpoints).

The worker's side of tables is :mod:`psframe.worker.model`, the ps task's
:mod:`psframe.ps.store.table_parts`; their optimizers are in
:mod:`psframe.optim.rows_kernels`.
"""
