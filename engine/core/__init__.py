"""The engine-core process: its loop, its entry point, the handle front ends hold, the IPC messages
(defined once, in messages.py), and the tensor-parallel rank worker it starts."""
