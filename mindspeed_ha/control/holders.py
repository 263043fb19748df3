"""The holders of each part of the model, kept as ranks register (issue 19).

A part is a (tp_rank, pp_rank, shard_id) of the one layout the ranks registered; its
holders are the ranks of every optimizer instance that hold that shard. The dying
checkpoint's selection (:func:`~mindspeed_ha.control.policy.dying.select_dying_checkpoint`)
reads them from :class:`HolderTable` instead of grouping every rank again after each
death: at 16,384 ranks the grouping and layout check were a third of its cost.

:class:`RankTable` is the controller's ``rank -> RankInfo`` dict
(``ClusterState.ranks``) that keeps its table up to date on every assignment: a rank's
registration, a new process of it (worker restart, rejoin), a hot switch's new process
taking its place, a successor's roster. A death changes no holder: the table holds the
``RankInfo`` objects themselves, and their ``alive`` / ``status`` / ``iteration`` are read
when the selection runs. Imports nothing of the project (duck-typed ``RankInfo``).
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, List, Optional, Tuple

ShardKey = Tuple[int, int, int]  # (tp_rank, pp_rank, shard_id)
LayoutKey = Tuple[int, int, int]  # (tp_size, pp_size, shards_per_instance)


class HolderTable:
    """Part -> its holders (``RankInfo``, ordered by rank), updated one rank at a time.

    :meth:`put` / :meth:`discard` cost O(log holders of the part); :meth:`grouped` is
    O(1) while no rank joined or left a part since the last call, else O(parts).
    """

    __slots__ = ("_key_of", "_by_key", "_layouts", "_outside", "_grouped")

    def __init__(self) -> None:
        self._key_of: Dict[int, Tuple[ShardKey, LayoutKey]] = {}
        self._by_key: Dict[ShardKey, List[Tuple[int, Any]]] = {}  # part -> [(rank, info)] by rank
        self._layouts: Dict[LayoutKey, int] = {}  # layout -> how many ranks registered it
        self._outside: set = set()  # ranks whose part is outside their own layout
        self._grouped: Optional[Tuple[Dict[ShardKey, List[Any]], int]] = None

    def put(self, info: Any) -> None:
        """``info`` is its rank's ``RankInfo`` now (a first registration or a new process)."""
        self.discard(info.rank)
        lay = info.layout
        key = (lay.tp_rank, lay.pp_rank, lay.shard_id)
        shape = (lay.tp_size, lay.pp_size, lay.shards_per_instance)
        self._key_of[info.rank] = (key, shape)
        self._layouts[shape] = self._layouts.get(shape, 0) + 1
        if not (0 <= key[0] < shape[0] and 0 <= key[1] < shape[1] and 0 <= key[2] < shape[2]):
            self._outside.add(info.rank)
        entries = self._by_key.setdefault(key, [])
        bisect.insort(entries, (info.rank, info), key=lambda e: e[0])
        self._grouped = None

    def discard(self, rank: int) -> None:
        """``rank`` holds nothing any more (no-op if it was not in the table)."""
        found = self._key_of.pop(rank, None)
        if found is None:
            return
        key, shape = found
        self._layouts[shape] -= 1
        if not self._layouts[shape]:
            del self._layouts[shape]
        self._outside.discard(rank)
        entries = self._by_key[key]
        del entries[bisect.bisect_left(entries, rank, key=lambda e: e[0])]
        if not entries:
            del self._by_key[key]
        self._grouped = None

    def holders_of(self, key: ShardKey) -> List[Tuple[int, Any]]:
        """``(rank, RankInfo)`` of every holder of part ``key``, by rank (empty: none). Not a copy."""
        return self._by_key.get(key, [])

    def grouped(self) -> Optional[Tuple[Dict[ShardKey, List[Any]], int]]:
        """Every part of the layout (tp, then pp, then shard order) -> its holders, and the
        shards per (tp, pp); None when no rank is in the table, the ranks registered more
        than one layout, or one reports a part outside it (the caller says which)."""
        if self._grouped is None:
            if len(self._layouts) != 1 or self._outside:
                return None
            (tp_size, pp_size, n_shards), = self._layouts
            self._grouped = ({(t, p, s): [i for _, i in self._by_key.get((t, p, s), ())]
                              for t in range(tp_size) for p in range(pp_size) for s in range(n_shards)}, n_shards)
        return self._grouped

    def __len__(self) -> int:
        return len(self._key_of)


class RankTable(dict):
    """``rank -> RankInfo`` whose :attr:`holders` follows every assignment and removal."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.holders = HolderTable()
        for rank, info in dict(*args, **kwargs).items():
            self[rank] = info

    def _table(self) -> HolderTable:
        table = self.__dict__.get("holders")  # absent while copy / pickle rebuilds the dict
        if table is None:
            table = self.holders = HolderTable()
        return table

    def __setitem__(self, rank: int, info: Any) -> None:
        super().__setitem__(rank, info)
        self._table().put(info)

    def __delitem__(self, rank: int) -> None:
        super().__delitem__(rank)
        self._table().discard(rank)

    def pop(self, rank: int, *default: Any) -> Any:
        out = super().pop(rank, *default)
        self._table().discard(rank)
        return out

    def clear(self) -> None:
        super().clear()
        self.holders = HolderTable()

    def update(self, *args: Any, **kwargs: Any) -> None:
        for rank, info in dict(*args, **kwargs).items():
            self[rank] = info

    def setdefault(self, rank: int, default: Any = None) -> Any:
        if rank not in self:
            self[rank] = default
        return self[rank]

    def popitem(self) -> Tuple[int, Any]:
        rank, info = super().popitem()
        self._table().discard(rank)
        return rank, info


__all__ = ["HolderTable", "RankTable", "ShardKey"]
