"""Speculative decoding: proposers guess the next tokens; one step verifies them all (DESIGN.md:
a verify is a catch-up of k + 1 tokens)."""
