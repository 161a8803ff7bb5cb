"""ps tasks added or drained while training goes on: a live re-layout.

- :mod:`psframe.ps.elastic.relayout`: the re-layout's state machine, and the parts a request gets;
- :mod:`psframe.ps.elastic.shard_codec`: those parts' format on the wire;
- :mod:`psframe.ps.elastic.fetch`: a task's reads of its parts from the tasks before;
- :mod:`psframe.ps.elastic.precopy`: table parts copied ahead of the cut;
- :mod:`psframe.ps.elastic.peers`: a ps task's calls to the other ps tasks.
"""
