"""Integrations of kvrs with other libraries, each importable only when its library is installed."""
