"""The device side of the engine core: the Worker (device state), the model runner, CUDA graphs, step inputs."""
