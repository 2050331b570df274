"""The host's room (memory.room) through the rootable procfs reader, on recorded and
hand-made /proc + cgroup trees (tests/data/proc/README.md says which is which): no limit
(v1's LONG_MAX, v2's ``max``), a limit with room, a tight limit, and unreadable or garbage
files, which must give a room that says why it is unknown, never an exception."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_xpu_memfix.core.units import MiB
from vllm_xpu_memfix.memory.room import host_room
from vllm_xpu_memfix.startup.staging import slots_for_room

DATA = Path(__file__).parent / "data" / "proc"
# MemAvailable of the recorded CPU-VM meminfo, which every tree here carries.
RECORDED_AVAILABLE = 23_809_352 * 1024
# A rank's staging, as the load lock plans it for the test bed's 0.21 legacy load: the
# 960 MiB shard and its converted and other weights (docs/design/load-lock.md), about 1.5x.
SHARD = 1440 * MiB


def copied(tmp_path: Path, tree: str) -> Path:
    return Path(shutil.copytree(DATA / tree, tmp_path / tree))


def test_v1_without_a_limit_recorded_is_memavailable():
    room = host_room(DATA / "cpu-vm-v1", 4242)
    assert room.cgroup.limit is None and room.cgroup.usage == 5_602_713_600
    assert room.bytes == RECORDED_AVAILABLE and room.problem is None
    assert "no cgroup memory limit" in room.describe()
    assert slots_for_room(room, SHARD, 2)[0] == 2


def test_v2_max_is_no_limit(tmp_path):
    tree = copied(tmp_path, "xe-cgroup-v2")
    (tree / "sys/fs/cgroup/system.slice/docker-abc.scope/memory.max").write_text("max\n")
    room = host_room(tree, 777)
    assert room.cgroup.limit is None and room.bytes == RECORDED_AVAILABLE


def test_v2_limit_with_room_leaves_memavailable_the_smaller():
    room = host_room(DATA / "xe-cgroup-v2", 777)
    assert room.cgroup.room == 44 * 1024 * MiB
    assert room.bytes == RECORDED_AVAILABLE
    assert "cgroup limit 65,536 MiB, used 20,480 MiB" in room.describe()


def test_a_tight_v2_limit_holds_one_shard_of_two():
    room = host_room(DATA / "container-v2-tight")
    assert room.bytes == 2560 * MiB  # 8 GiB limit, 5.5 GiB used, far below MemAvailable
    slots, why, _ = slots_for_room(room, SHARD, 2)
    assert slots == 1 and "room 2,560 MiB" in why and "1,440.0 MiB per rank" in why
    assert "the room holds 1 of the 2 ranks' staging at once" in why
    assert slots_for_room(room, SHARD / 4, 4)[0] == 4  # a quarter shard: all fit


def test_a_full_v1_limit_gives_one_slot_and_says_not_even_one_fits():
    room = host_room(DATA / "container-v1-full")
    assert room.bytes == 96 * MiB
    slots, why, _ = slots_for_room(room, SHARD, 8)
    assert slots == 1 and "not even one rank's staging fits" in why


def _memory_max(tree: Path) -> Path:
    return tree / "sys/fs/cgroup/memory.max"


GARBAGE = {
    "v2 limit": ("container-v2-tight", "sys/fs/cgroup/memory.max", "lots\n", "memory.max"),
    "v2 usage": ("container-v2-tight", "sys/fs/cgroup/memory.current", "", "memory.current"),
    "v1 limit": (
        "container-v1-full",
        "sys/fs/cgroup/memory/memory.limit_in_bytes",
        "-1x\n",
        "memory.limit_in_bytes",
    ),
    "cgroup list": ("container-v2-tight", "proc/self/cgroup", "garbage\n", "proc/self/cgroup"),
    "meminfo": ("container-v2-tight", "proc/meminfo", "MemAvailable: many kB\n", "MemAvailable"),
}


@pytest.mark.parametrize("case", GARBAGE)
def test_a_garbage_file_makes_the_room_unknown_and_one_slot(tmp_path, case):
    tree_name, relative, text, named = GARBAGE[case]
    tree = copied(tmp_path, tree_name)
    (tree / relative).write_text(text)
    room = host_room(tree)
    assert room.bytes is None and named in room.describe()
    slots, why, cramped = slots_for_room(room, SHARD, 2)
    assert slots == 1 and "room unknown" in why and "conservative" in why and cramped


def test_an_unreadable_limit_makes_the_room_unknown(tmp_path):
    """Made unreadable by a directory in its place: the tests run as root, for whom a mode
    of 000 hides nothing."""
    tree = copied(tmp_path, "container-v2-tight")
    _memory_max(tree).unlink()
    _memory_max(tree).mkdir()
    room = host_room(tree)
    assert room.bytes is None and "memory.max" in (room.problem or "")


@pytest.mark.parametrize(
    "membership",
    ["0::/system.slice/docker-3f9a.scope\n", "0::/\n"],
    ids=["host cgroup namespace", "private cgroup namespace"],
)
def test_a_v2_container_limit_is_found_with_or_without_a_private_namespace(tmp_path, membership):
    """Docker's cgroupns=host: /proc/self/cgroup gives the host's path of the container's
    cgroup, while /sys/fs/cgroup is mounted at that cgroup itself. The limit is found by
    the tail of the path under the mount, as with a private namespace ("0::/")."""
    tree = copied(tmp_path, "container-v2-tight")
    (tree / "proc/self/cgroup").write_text(membership)
    room = host_room(tree)
    assert room.cgroup.limit == 8 * 1024 * MiB and room.bytes == 2560 * MiB


def test_the_hosts_own_view_of_a_nested_cgroup_is_read_at_its_full_path():
    room = host_room(DATA / "xe-cgroup-v2", 777)
    assert room.cgroup.limit == 64 * 1024 * MiB


@pytest.mark.parametrize(
    ("relative", "text"),
    [("sys/fs/cgroup/memory.max", "12 GiB\n"), ("sys/fs/cgroup/memory.current", "-5\n")],
)
def test_a_junk_limit_under_a_host_namespace_path_is_unknown_never_no_limit(
    tmp_path, relative, text
):
    tree = copied(tmp_path, "container-v2-tight")
    (tree / "proc/self/cgroup").write_text("0::/system.slice/docker-3f9a.scope\n")
    (tree / relative).write_text(text)
    room = host_room(tree)
    assert room.bytes is None and room.problem and relative.rsplit("/", 1)[1] in room.problem
