"""Prolog, epilog and healthcheck flows, their entry points and their log."""
