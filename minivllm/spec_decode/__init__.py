"""Speculative decoding: the speculator feature, its proposers (draft model, n-gram), the cost model
that decides when proposals pay (the runner's sampler verifies the proposals: model/rejection_sampler.py)."""
