"""Sampling on the device: the sampler and its logit processors, hash-based random numbers, rejection sampling."""
