"""ps tasks added or drained while training goes on: a live re-layout.

- :mod:`psframe.ps.elastic.relayout`: the re-layout's state machine, and its parts' format;
- :mod:`psframe.ps.elastic.precopy`: table parts copied ahead of the cut;
- :mod:`psframe.ps.elastic.peers`: a ps task's calls to the other ps tasks.
"""
