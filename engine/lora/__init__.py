"""LoRA adapters: PEFT files read and checked, the per-step rows that pick each row's adapter, and the
product an adapter adds to a projection (kernels/lora.py on CUDA, torch on CPU)."""
