"""Integrations with model libraries; each module is imported explicitly, never by the package."""
