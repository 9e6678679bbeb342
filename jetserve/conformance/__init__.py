"""Conformance corpus for engine adapters and its translation-loss report."""
