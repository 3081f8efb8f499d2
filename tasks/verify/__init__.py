"""Verifiers: score a model response against a row's reference, in [0, 1]."""
