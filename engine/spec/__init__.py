"""Speculative decoding: drafters that propose tokens, and the verify step that accepts them."""
