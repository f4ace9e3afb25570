"""The ASGI application (`front`): the dispatcher that sends the two hot POSTs straight to
their routes, and the operator routes on a small Starlette app (models, health, readiness,
metrics), with the OpenAPI document they serve (`openapi`).
May import: gateway.completions, gateway.runtime, gateway.schemas, gateway.edge and the
shared modules of gateway/.
"""
