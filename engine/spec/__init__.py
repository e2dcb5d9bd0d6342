"""Speculative decoding: the drafters (n-gram, draft model) and the speculative round that verifies their drafts."""
