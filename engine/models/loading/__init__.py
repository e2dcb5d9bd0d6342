"""From checkpoint files to a model's weights: the loader, where each architecture's tensors go, and what
they become once read."""
