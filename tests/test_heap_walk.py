"""The whole-heap holder walk of a group rebuild (mindspeed_ha/recovery/holders.py), in
one process without torch: chunked gc calls find what one whole-heap call found, and a
finished frame of the rebuild (kept by a failed attempt's exception) is a holder."""

import gc

from mindspeed_ha.recovery import holders


class _Group:  # stands for a process group
    pass


def test_chunked_referrers_find_every_holder_and_only_holders(monkeypatch):
    monkeypatch.setattr(holders, "CHUNK", 97)  # many chunks, one ending mid-way
    target = _Group()
    kept = {"a": target, "b": [target], "c": (target, 1)}
    found = holders.referrers([target])
    assert {id(kept), id(kept["b"]), id(kept["c"])} <= set(map(id, found))
    assert all(any(x is target for x in gc.get_referents(h)) for h in found)


def test_a_finished_frame_of_the_rebuild_is_a_holder_not_the_walk_s_own():
    """Before, every frame of recovery/groups.py was left out as "the walk's own": the frame
    of a failed attempt's ``_create_like``, kept by its exception, held the old group unseen
    (swapped [], nothing named) -- now it is named as not swappable."""
    code = compile("def _create_like(old):\n    raise ConnectionError('Failed to recv')\n", "groups.py", "exec")
    ns = {"__name__": "mindspeed_ha.recovery.groups"}
    exec(code, ns)
    old, new = _Group(), _Group()
    try:
        ns["_create_like"](old)
    except ConnectionError as exc:
        kept = exc  # as a fault report keeps it
    holder = {"group": old}
    mapping = {id(old): (old, new)}
    swapped, unswapped = holders.swap(mapping, set(), holders.untracked_containers())
    assert holder["group"] is new and any("holder" not in s for s in swapped), swapped
    assert any("local 'old' of _create_like" in u for u in unswapped), unswapped
    del kept
