"""The usage ledger: records on their way to the Redis stream `usage` (`records`), the spool
they wait in while Redis is away (`spool`, its files in `spoolfile`), and the records Redis
took lately, sent again after a Sentinel failover (`recent`).
May import: routing.store, tiers, and the shared modules of routing/.
"""
