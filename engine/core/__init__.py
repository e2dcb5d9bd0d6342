"""The engine-core process: its loop, its entry point, the engine core (requests and the step), the handle
front ends hold, the IPC messages (defined once, in messages.py), and the tensor-parallel rank worker it starts."""
