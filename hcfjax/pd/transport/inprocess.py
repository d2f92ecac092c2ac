"""The inprocess kind: both ends in one process (tests); arrays handed over by reference, and a receiver's address
is its key in the Transport's registry."""

from __future__ import annotations

import numpy as np

from hcfjax.pd.transport.common import Part, TransferError
from hcfjax.pd.transport.receiver import Receiver


class InprocessLink:
    def __init__(self, registry: dict, dest: str):
        self.registry, self.dest = registry, dest

    def prepare(self, x):
        return np.asarray(x)

    def send(self, parts: list[Part]) -> None:
        rx = self.registry.get(self.dest)
        if rx is None:
            raise TransferError(f"no receiver at {self.dest}")
        rx._deliver(parts, sum(p.nbytes for p in parts))

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


class InprocessReceiver(Receiver):
    def __init__(self, registry: dict, address: str):
        super().__init__(host=True)
        self._registry, self.address = registry, address
        registry[address] = self

    def close(self) -> None:
        self._registry.pop(self.address, None)
        super().close()
