"""Machinery shared by every pack recipe: distributed setup, config checks, the training loop."""
