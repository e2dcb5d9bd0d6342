"""The CPU backend: attention, projections and fused ops in C, built at first use (build.py)."""
