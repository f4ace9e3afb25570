"""The product path of `POST /v1/completions` and `/v1/chat/completions`: one request's walk
(`route`), its state (`exchange`), the hop to the worker (`hop`), the answer rewritten on its
way back (`answer`), its usage record (`billing`) and the trace context passed on (`trace`).
May import: gateway.runtime, gateway.schemas, gateway.edge, the shared modules of gateway/,
routing/ and tiers/.
"""
