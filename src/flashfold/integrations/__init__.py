"""Integrations with the libraries users already run (optional extras)."""
