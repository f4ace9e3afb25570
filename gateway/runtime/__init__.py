"""What a running gateway holds: its config (`settings`), live reload (`reload`), API keys
(`auth`), and the state built from them and started in the lifespan (`state`).
May import: the shared modules of gateway/, routing/ and tiers/.
"""
