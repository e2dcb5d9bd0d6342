"""A tensor-parallel rank other than 0: its own process and device, an EngineCore over its
shard of the model, following rank 0 step by step.

Rank 0 (the engine-core process, engine/core/loop.py) sends, before each of its steps, what
it took from the front ends since the last one (StepInputs: new requests with their seeds,
aborts). This rank applies the same inputs and runs the same step; its scheduler makes the
same decisions, its collectives meet rank 0's, and it samples the same tokens from the
gathered logits, which it throws away (rank 0 answers the front ends). It exits when rank 0
says stop, and dies with its parent (the engine-core process) or when a collective fails."""

from __future__ import annotations

import logging
import os
import signal

from graphserve.engine.config import EngineConfig

logger = logging.getLogger("graphserve.engine")


def run_worker(config: EngineConfig, rank: int, init_method: str, parent_pid: int, log_level: int) -> None:
    """The process's entry point."""
    from graphserve.engine.child_process import (
        die_with_parent,
        dump_stacks_on_sigusr1,
        freeze_startup_objects,
    )

    die_with_parent(parent_pid)
    dump_stacks_on_sigusr1()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s",
                        datefmt="%H:%M:%S")
    from graphserve.engine.core.engine_core import EngineCore
    from graphserve.engine.core.messages import decode_step_inputs

    try:
        core = EngineCore(config, rank, init_method)
        freeze_startup_objects()
        while True:
            inputs = decode_step_inputs(core.tp.broadcast_bytes(None))
            if inputs.stop:
                break
            for add, seed in zip(inputs.adds, inputs.seeds):
                core.add_sequence(core.make_sequence(add.request_id, add.prompt_token_ids, add.params, seed))
            for request_id in inputs.aborts:
                core.abort(request_id)
            for kind in inputs.faults:
                core.inject_fault(kind)
            if not inputs.wake_only:  # rank 0 steps too
                core.step()
    except BaseException:
        logger.exception("tensor-parallel rank %d stopped", rank)
        os._exit(1)
    os._exit(0)
