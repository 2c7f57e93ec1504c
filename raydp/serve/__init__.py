"""HTTP front-ends: N API server processes sharing one listening socket.

Owns the HTTP application (``http``) and the processes that serve it
(``processes``). Each process builds a :mod:`raydp.client` from the cluster's
endpoints; no Ray runs in them. Imports the client, :mod:`raydp.backend` and
:mod:`raydp.processes`; never Ray or a backend.
"""
