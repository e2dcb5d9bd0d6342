"""AdapterCache: LoRA adapters' weights in host memory, read from disk on a thread of their own so that
loading one never stalls the engine's loop. At most `capacity` adapters stay, least recently used out
first, but never one a live request runs with."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from graphserve.engine.lora.adapter import AdapterWeights, load_adapter
from graphserve.engine.lora.layout import LoraLayout
from graphserve.engine.request import LoraRequest


def _one_torch_thread() -> None:
    """The loading thread's torch ops run in it alone. With threads of its own (torch's OpenMP team for this
    thread) the process holds more OpenMP threads than cores, and libgomp then stops spinning between
    parallel loops: every kernel of every step afterwards waits for its threads' futex wake-up (served,
    8 adapters on 2 cores: a sixth of the engine's time in the kernel's scheduler). Threads started later
    take one torch thread too (torch's default for new threads); the engine's own thread keeps its count."""
    torch.set_num_threads(1)


class AdapterCache:
    def __init__(self, layout: LoraLayout, max_rank: int, dtype: torch.dtype, capacity: int, pin_memory: bool):
        self.layout, self.max_rank, self.dtype = layout, max_rank, dtype
        self.capacity = capacity
        self.pin_memory = pin_memory  # page-locked: copies into the device slots do not wait
        self._weights: OrderedDict[int, AdapterWeights] = OrderedDict()
        self._loading: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="graphserve-lora", initializer=_one_torch_thread)

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._weights

    def __len__(self) -> int:
        return len(self._weights)

    def get(self, lora_id: int) -> AdapterWeights:
        """A cached adapter's weights (KeyError if not cached), now the most recently used."""
        self._weights.move_to_end(lora_id)
        return self._weights[lora_id]

    def start(self, lora: LoraRequest) -> None:
        """Start reading `lora` unless it is cached or being read."""
        if lora.lora_id not in self._weights and lora.lora_id not in self._loading:
            self._loading[lora.lora_id] = self._pool.submit(load_adapter, lora.path, self.layout, self.max_rank,
                                                            self.dtype, self.pin_memory)

    def ready(self, lora: LoraRequest, live: set[int]) -> bool:
        """Whether `lora` is cached; one that finished reading joins the cache, making room by dropping
        the least recently used adapters not in `live`. Raises the reading's error (AdapterError)."""
        if lora.lora_id in self._weights:
            return True
        future = self._loading.get(lora.lora_id)
        if future is None:
            self.start(lora)
            return False
        if not future.done():
            return False
        del self._loading[lora.lora_id]
        weights = future.result()  # raises what loading raised
        for old in [i for i in self._weights if i not in live][:max(0, len(self._weights) + 1 - self.capacity)]:
            del self._weights[old]
        self._weights[lora.lora_id] = weights
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
