"""The commands (`main`: serve, demo, sim; `keys`: keys create; `usage` and `exporter`: usage
export) and the demo (`demo`). The top of the walk: it may import every room but the product path
(gateway.completions), which it reaches through gateway.app.
"""
