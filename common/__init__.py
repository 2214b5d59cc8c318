"""Plumbing shared by every entry point and library module: flags, errors, file access."""
