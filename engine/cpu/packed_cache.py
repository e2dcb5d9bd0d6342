"""A converted GGUF folder's projections as the quantized CPU kernel lays them out, kept beside its blocks:
a start after the first reads them instead of repacking every projection again (numpy work of ~2 s
for the embedded default model, at every engine start).

The file carries a stamp of the pack format and of the blocks file it came from (size, modification
time); one whose stamp differs is repacked and rewritten. Written to a temporary name and moved into
place, so processes starting together never read half a file; a folder that cannot be written (a
read-only cache) only means packing at each start.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from graphserve.engine.cpu.quant_linear import GGUF_BLOCKS_FILE, QuantizedWeight

logger = logging.getLogger("graphserve.engine")

PACKED_FILE = "gguf/packed.safetensors"
# bump when quant_linear.pack_quantized's layout changes: files of another format are repacked
PACKED_FORMAT = "1"

Parts = tuple[QuantizedWeight, ...]


class PackedCache:
    """Packed parts by the source tensors' names, read from the folder's file when it is current."""

    def __init__(self, folder: Path) -> None:
        self.file = folder / PACKED_FILE
        source = (folder / GGUF_BLOCKS_FILE).stat()
        self.stamp = f"{PACKED_FORMAT}:{source.st_size}:{source.st_mtime_ns}"
        self.parts: dict[str, Parts] = self._read()
        self.added = False

    def _read(self) -> dict[str, Parts]:
        if not self.file.is_file():
            return {}
        try:
            with safe_open(str(self.file), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("stamp") != self.stamp:
                    return {}
                shapes = json.loads(meta["parts"])
                # cloned: the kernel reads panels with aligned vector loads, and a tensor read from the
                # file may start anywhere; torch's allocator aligns to 64 bytes, as pack_quantized's do
                return {key: tuple(QuantizedWeight(qtype, n, k, f.get_tensor(f"{key}#{i}").clone())
                                   for i, (qtype, n, k) in enumerate(parts))
                        for key, parts in shapes.items()}
        except (OSError, ValueError, KeyError) as exc:  # unreadable: packed again and rewritten
            logger.warning("%s: ignored (%s); repacking", self.file, exc)
            return {}

    def get(self, names: list[str]) -> Parts | None:
        return self.parts.get("|".join(names))

    def put(self, names: list[str], parts: Parts) -> None:
        self.parts["|".join(names)] = parts
        self.added = True

    def save(self) -> None:
        """Writes the file if anything was packed since it was read."""
        if not self.added:
            return
        tensors = {f"{key}#{i}": part.panels for key, parts in self.parts.items() for i, part in enumerate(parts)}
        shapes = {key: [[p.qtype, p.n, p.k] for p in parts] for key, parts in self.parts.items()}
        tmp = self.file.with_name(f"{self.file.name}.{os.getpid()}.tmp")
        try:
            save_file(tensors, str(tmp), metadata={"stamp": self.stamp, "parts": json.dumps(shapes)})
            os.replace(tmp, self.file)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            logger.info("packed GGUF projections not kept (%s): they are packed again at the next start", exc)
        self.added = False

