"""``psframe serve``: follow a training job's checkpoint directory and serve the model over HTTP/JSON.

The chief commits full checkpoints and, between them, deltas (``Checkpointing(delta_steps=...)``
or ``delta_secs``). ``psframe serve --checkpoint_dir DIR`` loads the newest full checkpoint as a
serving snapshot, applies each delta as it is committed, moves to the next full checkpoint when
one comes, and answers row lookups, parameter reads and the model's predictions from one whole
version at a time. The parts, bottom to top:

- :mod:`psframe.serve.versions`: a version, and the holder whose one reference a request reads;
- :mod:`psframe.serve.delta_update`: a delta checkpoint as an update, from its own shards only;
- :mod:`psframe.serve.model`: each version's model, and a request's predictions;
- :mod:`psframe.serve.follower`: the directory turned into versions, refusing what is damaged;
- :mod:`psframe.serve.http_api`: the HTTP/JSON API (Starlette);
- :mod:`psframe.serve.process`: the follower and the server (uvicorn) run and stopped.

Only this package imports the web framework (the ``serve`` extra): training never loads it.
``docs/guides/serve.md`` is the guide.
"""
