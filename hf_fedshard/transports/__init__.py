"""Transports: how federation groups reach each other (``mesh``: the groups of one job on one world mesh)."""
