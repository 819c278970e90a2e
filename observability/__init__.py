"""Logging, tracing and metrics set-up shared by every service."""
