"""The OpenAI-compatible HTTP front end: FastAPI routes served by uvicorn in processes of
their own, each a client of the scheduler through ``cbpipe.client.AsyncClient``.

``cbpipe-launch --port P`` starts it; ``process.server_main`` is a server process's entry.
"""
