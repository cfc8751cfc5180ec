"""The offload engine of one device of several that split every MoE layer's experts
(runtime.devices > 1 with an offload budget; oled.model.parallel).

Each process holds only its contiguous share of each layer's experts: its host store, its slot
caches (sized by the budget over its share) and its planner (oled.policies.share) know that
share alone, in its own expert ids. The model's routing ids are mapped at the layer's boundary,
on the device for the slot lookups and on the host for the planner; the other shares' pairs
are zeros here, and one all-reduce sums every process's pairs before the top-k sum, as the
resident split does, so the processes decode exactly the tokens of one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from oled.model.experts import ExpertStore
from oled.model.parallel import ParallelError, Split, all_reduce
from oled.offload.encoded import EncodedCopies
from oled.offload.engine import OffloadEngine
from oled.policies.planner import Planner
from oled.policies.share import SharePlanner, share_ids


class ShardedEngine(OffloadEngine):
    """An OffloadEngine over one process's share of the experts (`split`), planned by a
    SharePlanner; its layer calls launch from Python (the C driver reads the model's ids)."""

    def __init__(
        self,
        *,
        store: ExpertStore,
        device: torch.device,
        planner: Planner,
        split: Split,
        predict: Callable[[int, Tensor], Tensor | np.ndarray] | None = None,
        driver: bool | None = None,
        encoded: EncodedCopies | None = None,
    ) -> None:
        """As OffloadEngine's, over `split`'s share (`store` and `planner` of its experts);
        `driver` True is refused (its layer calls launch from Python)."""
        if driver:
            raise ParallelError("layer calls cannot launch from C with runtime.devices > 1")
        if store.num_experts != split.per or planner.num_experts != split.per:
            raise ParallelError(
                f"a store of {store.num_experts} experts and a planner of "
                f"{planner.num_experts} for a share of {split.per}"
            )
        if not isinstance(planner, SharePlanner):
            raise ParallelError("a share's engine plans with a SharePlanner (its routing ids)")
        self.split = split
        self.local_host = share_ids(split.num_experts, split.world, split.rank)  # [E]
        self.local_device = torch.from_numpy(self.local_host).to(device)  # [E]
        super().__init__(
            store=store,
            device=device,
            planner=planner,
            predict=predict,
            driver=False,
            encoded=encoded,
        )

    def local_ids(self, ids: np.ndarray) -> np.ndarray:
        """[T, K]: the share's id of each pair's expert, `split.per` for the others'."""
        return self.local_host[ids]

    def slots(self, slot_map: Tensor, ids: Tensor) -> Tensor:
        """[T, K]: the slot of each pair of this share's experts, -1 for the others'."""
        padded = F.pad(slot_map, (0, 1), value=-1)  # [per + 1]: the others' id has no slot
        return padded[self.local_device[ids]]

    def gather(self, pairs: Tensor) -> Tensor:
        """The pairs [T, K, H] of every share, summed over the processes."""
        return all_reduce(pairs)
