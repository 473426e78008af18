"""Turning retrieved continuations into drafts."""
