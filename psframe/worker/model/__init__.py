"""The model a worker trains: its replica, its tables, and how their tensors travel.

- :mod:`psframe.worker.model.replica`: the replica, bound to the ps tasks' shards;
- :mod:`psframe.worker.model.staging`: where the replica lives, how tensors reach the wire;
- :mod:`psframe.worker.model.tables`: embedding tables, pulled and pushed row by row;
- :mod:`psframe.worker.model.table_views`: one table as the worker sees it, and its lookups;
- :mod:`psframe.worker.model.row_pulls`: a table's rows, pulled from the ps parts that hold them;
- :mod:`psframe.worker.model.attached_forward`: a table module's forward while attached;
- :mod:`psframe.worker.model.dynamic`: dynamic tables (any int64 id);
- :mod:`psframe.worker.model.prefetch`: the next batch's rows, pulled ahead;
- :mod:`psframe.worker.model.overlap`: a step's messages sent while backward runs.
"""
