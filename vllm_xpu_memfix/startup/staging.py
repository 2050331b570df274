"""Host staging of on-the-fly quantization, per rank, and how many ranks may stage at once.

One figure, used by the load lock (to size its slots) and by the start-up model (the
``load`` phase): a rank stages the 16-bit weights it converts plus the temporaries of the
largest unit converted at once (``STAGING_BYTES_PER_PARAM`` a parameter: its 16-bit copy,
the fp32 upcast, the int4 result and its scales). Under sym_int4's legacy load the rank
first buffers its whole 16-bit shard, so the shard comes on top.

Checked on the CPU test bed, where the device memory is host memory too: the TP 2 legacy
load of the ~1 B-parameter benchmark model (benchmarks/results/load-lock-2026-12-04.md,
lock off) peaked 2,891 MiB summed over two ranks above process start, 1,445 MiB a rank.
Per rank this figure gives 960 MiB of shard + 104 MiB for the merged gate/up unit (16.8 M
parameters), and the load lock adds on the CPU the converted weights (960 / 2 x 0.535 =
257 MiB) and the other weights (embedding and head, 125 MiB): 1,446 MiB. On an XPU the
staging alone, 1,064 MiB, stays on the host.
"""

from __future__ import annotations

from typing import NamedTuple

from vllm_xpu_memfix.core.units import MiB
from vllm_xpu_memfix.memory.room import Room

# Host bytes staged per parameter of the unit converted at once: bf16 copy, fp32 upcast,
# int4, fp16 scales per group of 128.
STAGING_BYTES_PER_PARAM = 2 + 4 + 0.5 + 2 / 128
# The share of the room the loading ranks may plan to fill. The rest is for what grows
# meanwhile and is not in the figure: other processes, the checkpoint's page cache in a
# container (charged to its cgroup), and MemAvailable being the kernel's estimate.
ROOM_SHARE = 0.8


def per_rank(unit_params: float, shard_bytes: float = 0.0) -> float:
    """Host bytes one rank stages: the largest unit's temporaries (``unit_params`` of this
    rank), plus ``shard_bytes`` where the legacy load buffers the rank's whole shard."""
    return unit_params * STAGING_BYTES_PER_PARAM + shard_bytes


class RoomSlots(NamedTuple):
    slots: int
    why: str
    cramped: bool  # the room is unknown or holds not even one rank's staging: a WARNING


def slots_for_room(room: Room, staging: float, ranks: int) -> RoomSlots:
    """How many ranks' staging (``staging`` bytes each, from :func:`per_rank`) the room
    holds (1 to ``ranks``), and the line saying why. A room that could not be read gives
    1, the choice that cannot overfill the host."""
    # The room's figure; how it was made up (or why it is unknown) is the caller's detail.
    head = "room unknown" if room.bytes is None else f"room {room.bytes / MiB:,.0f} MiB"
    measured = f"{head}, staging {staging / MiB:,.1f} MiB per rank, {ranks} ranks on this host"
    if room.bytes is None:
        return RoomSlots(1, f"{measured} -> 1 slot(s): the conservative choice", True)
    fits = int(room.bytes * ROOM_SHARE // staging) if staging > 0 else ranks
    slots = min(ranks, max(1, fits))
    if slots == ranks:
        reason = "every rank's staging fits at once, so they load unserialised"
    elif fits < 1:
        reason = "not even one rank's staging fits: one loads at a time"
    else:
        reason = f"the room holds {fits} of the {ranks} ranks' staging at once"
    return RoomSlots(slots, f"{measured} -> {slots} slot(s): {reason}", fits < 1)
