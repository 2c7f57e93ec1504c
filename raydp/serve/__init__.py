"""HTTP front-ends: an OpenAI-compatible API, served by N processes sharing one listening socket.

The app (``app``: ``build_app``) over its routes (``completions``, ``chat``;
``text_answer`` writes their text answers, ``generation`` runs one request),
request bodies (``bodies``), errors (``api_errors``), the API-key check
(``api_keys``), encodings
(``responses``) and Prometheus metrics (``metrics``); text goes through a
:mod:`raydp.text` tokenizer (``tokenizer`` re-exports the byte tokenizer,
where it used to live); uvicorn serving it on a shared socket with
connection timers, over HTTP or HTTPS (``server``: ``serve_on_socket``,
``serve_forever``; ``protocol``); the settings of a server (``settings``); and the processes
that run it (``processes``). Each process builds a :mod:`raydp.client` from
the cluster's endpoints; no Ray runs in them. Imports the client,
:mod:`raydp.text`, :mod:`raydp.backend` and :mod:`raydp.processes`; never Ray or a backend.
"""
