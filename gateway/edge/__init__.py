"""The server edge: the HTTP/1.1 protocol (`protocol`), uvicorn's servers on sockets bound
first (`server`, `listen`), `serve --workers N` (`workers`), plain-ASGI helpers (`asgi`), the
request body's JSON (`body`), log lines (`logs`) and the access log (`access`). Nothing here
knows about models, tiers or Redis.
May import: gateway.errors and gateway.metrics; nothing of routing/ or tiers/ itself.
"""
