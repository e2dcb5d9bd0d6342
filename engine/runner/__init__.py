"""The model runner (engine-core process): step inputs, prefill, decode CUDA graphs, the sampler."""
