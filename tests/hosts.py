"""Host trees for the driver guard and doctor, built in the formats the kernel and dpkg use.

No Intel GPU host can be reached from here, so these are constructed, not recorded:
- sysfs: /sys/class/drm/cardN/device/{vendor,device,uevent} as the PCI core prints them
  ("0x8086\\n", "PCI_SLOT_NAME=0000:03:00.0"), xe's tile0/physical_vram_size_bytes, and
  connector entries (card1-DP-1) that must be skipped;
- dpkg: /var/lib/dpkg/status stanzas (Package / Status / Version);
- /proc/meminfo in the kernel's "Key:   value kB" format;
- /proc/sys/kernel/osrelease as uname -r prints it (None: the file is absent). The default
  is torch-xpu-ops #5428's kernel: 7.1, which has compute-runtime #916's fix.
Device ids and runtime versions are those of public reports (compute-runtime #953, #968).
"""

from __future__ import annotations

from pathlib import Path

GiB = 1024**3
B70, B60, NVIDIA_L4 = (0x8086, 0xE223), (0x8086, 0xE211), (0x10DE, 0x27B8)
A770 = (0x8086, 0x56A0)  # DG2, the GPU of compute-runtime #916's report


def build_host(
    root: Path,
    gpus: list[tuple[int, int]],
    *,
    runtime: str | None = "26.14.37833.4",
    lib_build: str | None = None,
    mem_total_gib: int = 128,
    mem_available_gib: float = 120.0,
    vram_gib: int | None = 32,
    kernel: str | None = "7.1.8+deb13-amd64",
) -> Path:
    drm = root / "sys/class/drm"
    drm.mkdir(parents=True)
    for index, (vendor, device) in enumerate(gpus):
        card = drm / f"card{index + 1}"
        dev = card / "device"
        (dev / "tile0").mkdir(parents=True)
        (dev / "vendor").write_text(f"0x{vendor:04x}\n")
        (dev / "device").write_text(f"0x{device:04x}\n")
        (dev / "uevent").write_text(f"DRIVER=xe\nPCI_SLOT_NAME=0000:{3 + index:02x}:00.0\n")
        if vram_gib is not None and vendor == 0x8086:
            (dev / "tile0/physical_vram_size_bytes").write_text(f"{vram_gib * GiB}\n")
        (drm / f"card{index + 1}-DP-1").mkdir()
    (drm / "renderD128").mkdir()
    dpkg = root / "var/lib/dpkg"
    dpkg.mkdir(parents=True)
    stanzas = ["Package: libze1\nStatus: install ok installed\nVersion: 1.28.2-1~24.04\n"]
    if runtime:
        stanzas.append(
            f"Package: intel-opencl-icd\nStatus: install ok installed\nVersion: {runtime}-1~24.04\n"
        )
        stanzas.append(
            f"Package: libze-intel-gpu1\nStatus: install ok installed\nVersion: {runtime}-1~24.04\n"
        )
    stanzas.append(
        "Package: intel-level-zero-gpu\nStatus: deinstall ok config-files\n"
        "Version: 1.3.29735.27-914~22.04\n"
    )
    (dpkg / "status").write_text("\n".join(stanzas))
    if lib_build:
        lib = root / "usr/lib/x86_64-linux-gnu"
        lib.mkdir(parents=True)
        (lib / f"libze_intel_gpu.so.1.14.{lib_build}").write_text("")
        (lib / "libze_intel_gpu.so.1").write_text("")
    proc = root / "proc/self"
    proc.mkdir(parents=True)
    kib = 1024
    (root / "proc/meminfo").write_text(
        f"MemTotal:       {mem_total_gib * GiB // kib} kB\n"
        f"MemFree:        {int(mem_available_gib * GiB) // kib} kB\n"
        f"MemAvailable:   {int(mem_available_gib * GiB) // kib} kB\n"
        f"Cached:         {2 * GiB // kib} kB\n"
        f"SwapTotal:             0 kB\nSwapFree:              0 kB\n"
        f"Committed_AS:   {4 * GiB // kib} kB\n"
    )
    (proc / "status").write_text("Name:\tpython3\nRssAnon:\t  204800 kB\nRssFile:\t  102400 kB\n")
    (proc / "cgroup").write_text("0::/\n")
    if kernel is not None:
        (root / "proc/sys/kernel").mkdir(parents=True)
        (root / "proc/sys/kernel/osrelease").write_text(f"{kernel}\n")
    return root


def qwen_27b_like(directory: Path) -> Path:
    """Sparse bf16 checkpoint shaped like a 27B dense Qwen (vocab 248320), 18 shards."""
    from vllm_xpu_memfix.memory.checkpoint import write_sparse_checkpoint

    hidden, inter, vocab, layers = 5120, 17408, 248320, 64
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.embed_tokens.weight": ("BF16", (vocab, hidden))
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": ("BF16", (6144, hidden)),
                p + "self_attn.k_proj.weight": ("BF16", (1024, hidden)),
                p + "self_attn.v_proj.weight": ("BF16", (1024, hidden)),
                p + "self_attn.o_proj.weight": ("BF16", (hidden, 6144)),
                p + "mlp.gate_proj.weight": ("BF16", (inter, hidden)),
                p + "mlp.up_proj.weight": ("BF16", (inter, hidden)),
                p + "mlp.down_proj.weight": ("BF16", (hidden, inter)),
                p + "input_layernorm.weight": ("BF16", (hidden,)),
                p + "post_attention_layernorm.weight": ("BF16", (hidden,)),
            }
        )
    tensors["model.norm.weight"] = ("BF16", (hidden,))
    tensors["lm_head.weight"] = ("BF16", (vocab, hidden))
    write_sparse_checkpoint(directory, tensors, shards=18)
    return directory


RAPTOR_LAKE_IGPU = (0x8086, 0xA7A0)  # the Iris Xe of most 13th-generation Intel desktops


def add_igpu(root: Path, gpu: tuple[int, int] = RAPTOR_LAKE_IGPU) -> Path:
    """An integrated GPU as xe shows it: card0 on the root complex's bus (0000:00:02.0,
    first in PCI order), a tile directory and no VRAM of its own."""
    dev = root / "sys/class/drm/card0/device"
    (dev / "tile0").mkdir(parents=True)
    (dev / "vendor").write_text(f"0x{gpu[0]:04x}\n")
    (dev / "device").write_text(f"0x{gpu[1]:04x}\n")
    (dev / "uevent").write_text("DRIVER=xe\nPCI_SLOT_NAME=0000:00:02.0\n")
    return root


def add_tiles(root: Path, card: str, tiles: int) -> Path:
    """More xe tile directories on ``card`` (a two-tile Data Center GPU Max shows tile0 and
    tile1), each with the same VRAM as tile0."""
    dev = root / "sys/class/drm" / card / "device"
    size = (dev / "tile0/physical_vram_size_bytes").read_text()
    for index in range(1, tiles):
        (dev / f"tile{index}").mkdir()
        (dev / f"tile{index}/physical_vram_size_bytes").write_text(size)
    return root


MAX_1550 = (0x8086, 0x0BD5)  # compute-runtime's device_ids_configs_pvc.h (pvcXtDeviceIds)


def as_i915(root: Path, card: str, tiles: int) -> Path:
    """``card`` as i915 shows a Data Center GPU Max: no xe tile directory, its tiles as
    ``gt/gt0`` ... (compute-runtime's ioctl_helper_i915.cpp reads a sub-device's sysfs under
    ``/gt/gt<tile>/``), and no VRAM file i915 and xe share: its memory is not read."""
    card_dir = root / "sys/class/drm" / card
    dev = card_dir / "device"
    for tile in dev.glob("tile*"):
        for entry in tile.iterdir():
            entry.unlink()
        tile.rmdir()
    (dev / "uevent").write_text((dev / "uevent").read_text().replace("DRIVER=xe", "DRIVER=i915"))
    for index in range(tiles):
        (card_dir / f"gt/gt{index}").mkdir(parents=True)
    return root
