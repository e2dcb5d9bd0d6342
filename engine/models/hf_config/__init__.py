"""The parts of a Hugging Face config.json that need more than Llama's fields (an architecture's own, the
mixture of experts, sliding windows), read as transformers reads them, with a clear error for what is not served."""
