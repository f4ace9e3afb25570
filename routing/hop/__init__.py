"""The hop to GPU workers: the keep-alive HTTP/1.1 connection (`http1`) and its pool
(`client`), the hop's settings (`upstream`), a model's endpoints as this replica holds them
(`endpoints`) and which of them are in rotation (`health`).
May import: tiers and the shared modules of routing/; never the store nor admission (the
edge passes the lease's endpoint in).
"""
