"""graphserve's HTTP edge: OpenAI protocol models, routes, SSE, errors, auth, metrics, CLI.

It knows nothing of tensors. It serves through `engine.AsyncEngine` and uses the engine's
request types (`engine.request`), errors (`engine.errors`) and config (`engine.config`);
`graphserve generate` runs `engine.LLM` directly.
"""
