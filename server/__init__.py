"""graphserve's HTTP edge: OpenAI protocol models, routes, SSE, errors, auth, metrics, CLI.

It knows nothing of tensors; it talks only to `engine.AsyncEngine`.
"""
