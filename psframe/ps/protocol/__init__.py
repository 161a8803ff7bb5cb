"""The rules a ps task keeps between its workers, in plain Python and torch. No network.

- :mod:`psframe.ps.protocol.ledger`: which pushes of each worker were applied (each once);
- :mod:`psframe.ps.protocol.roster`: which workers were heard from, busy, finished;
- :mod:`psframe.ps.protocol.sync`: the synchronous barrier (SyncReplicas);
- :mod:`psframe.ps.protocol.round_cut`: a checkpoint's or a re-layout's cut of its rounds;
- :mod:`psframe.ps.protocol.staleness`: bounded staleness;
- :mod:`psframe.ps.protocol.data_ranges`: ranges of a data set handed to workers.

The service (:mod:`psframe.ps.service`) translates requests into calls here.
"""
