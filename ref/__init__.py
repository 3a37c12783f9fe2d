"""Readable PyTorch references: the specification of every feature (each file stands alone)."""
