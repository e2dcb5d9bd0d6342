"""The routed-experts MLPs: Qwen3-MoE and Mixtral's, and gpt-oss's."""
