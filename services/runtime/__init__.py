"""Shared service runtime: typed config loading, the one lifecycle, heartbeats.

This is library code every service uses; it holds no service logic."""
