"""HTTP front-ends: an OpenAI-compatible API, served by N processes sharing one listening socket.

The app (``app``: ``build_app``) over its routes (``completions``,
``generation``), request bodies (``bodies``), the byte tokenizer
(``tokenizer``), errors (``api_errors``), encodings (``responses``) and
Prometheus metrics (``metrics``); uvicorn serving it on a shared socket with
connection timers (``server``: ``serve_on_socket``, ``serve_forever``;
``protocol``); the settings of a server (``settings``); and the processes
that run it (``processes``). Each process builds a :mod:`raydp.client` from
the cluster's endpoints; no Ray runs in them. Imports the client,
:mod:`raydp.backend` and :mod:`raydp.processes`; never Ray or a backend.
"""
