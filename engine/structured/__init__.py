"""Structured outputs: grammar compilation (front ends and core) and the mask feed (engine core)."""
