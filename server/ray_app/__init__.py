"""graphserve replicas on Ray Serve: an ingress that computes each prompt's prefix-cache keys, a
request router that sends a prompt to the replica holding its longest cached prefix, and the replica
deployment (one engine, the same OpenAI app). Needs `pip install graphserve[ray]`."""
