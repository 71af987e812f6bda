"""Speculative decoding: the speculator feature, its proposers (draft model, n-gram), the cost model
that decides when proposals pay, and rejection sampling."""
