"""The one table of Intel GPUs (PCI id, family, product, memory) and the one table of
Intel's llm-scaler vLLM images (their sym_int4, the variables their Dockerfile sets, the
compute-runtime they bundle), each row with its source. The driver guard, the start-up
model and doctor all read these; nothing else lists a GPU or an image.

A host file's own value always wins over a row here (``[gpu] memory_gib``,
``[driver] compute_runtime``, ``[env]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# --- GPU models ---------------------------------------------------------------------------
# Battlemage PCI device ids, from compute-runtime's
# shared/source/xe2_hpg_core/bmg/definitions/device_ids_configs_bmg.h. Whether a GPU is
# Battlemage is read from these sets alone, whether or not its product is in GPU_MODELS.
BMG_G21 = frozenset(
    {0xE202, 0xE209, 0xE20B, 0xE20C, 0xE20D, 0xE210, 0xE211, 0xE212, 0xE215, 0xE216}
)
BMG_G31 = frozenset({0xE220, 0xE221, 0xE222, 0xE223})
# Device ids: compute-runtime's device_ids_configs_bmg.h (driver.BMG_G21 / BMG_G31) and
# shared/source/xe_hpg_core/dg2/definitions/device_ids_configs_dg2_base.h (DG2 G10: 0x56A0
# A770, 0x56A1 A750, 0x56A2 A580; G11: 0x56A5 A380; G12: 0x56B3 Pro A60). Names per id:
# the PCI ID Repository (pci.ids). Memory: Intel's product pages (A770: the 16 GB card;
# an 8 GB A770 exists, so give memory_gib for it).


@dataclass(frozen=True)
class GpuModel:
    name: str
    device_id: int
    memory_gib: float
    note: str = ""


GPU_MODELS = (
    GpuModel("Arc Pro B70", 0xE223, 32),
    GpuModel("Arc Pro B60", 0xE211, 24),
    GpuModel("Arc Pro B50", 0xE212, 16),
    GpuModel("Arc B580", 0xE20B, 12),
    GpuModel("Arc B570", 0xE20C, 10),
    GpuModel("Arc A770", 0x56A0, 16, "the 16 GB card assumed; an 8 GB A770 exists"),
    GpuModel("Arc A750", 0x56A1, 8),
    GpuModel("Arc A580", 0x56A2, 8),
    GpuModel("Arc A380", 0x56A5, 6),
    GpuModel("Arc Pro A60", 0x56B3, 12),
)
_BY_NAME = {m.name.lower(): m for m in GPU_MODELS}
_BY_ID = {m.device_id: m for m in GPU_MODELS}


def family(device_id: int) -> str | None:
    """``Battlemage G21`` / ``Battlemage G31`` by compute-runtime's id lists, else None."""
    if device_id in BMG_G21:
        return "Battlemage G21"
    if device_id in BMG_G31:
        return "Battlemage G31"
    return None


def model_named(name: str) -> GpuModel | None:
    """``Arc Pro B70``, ``arc pro b70`` or ``B70`` (the name without ``Arc``/``Arc Pro``)."""
    wanted = " ".join(name.lower().split())
    if wanted in _BY_NAME:
        return _BY_NAME[wanted]
    short = [m for m in GPU_MODELS if m.name.lower().split()[-1] == wanted]
    return short[0] if len(short) == 1 else None


def model_of(device_id: int) -> GpuModel | None:
    return _BY_ID.get(device_id)


def product(device_id: int) -> str:
    """The product's name, else its family, else ``Intel GPU``."""
    known = _BY_ID.get(device_id)
    return known.name if known else (family(device_id) or "Intel GPU")


def memory_gib(device_id: int) -> float | None:
    known = _BY_ID.get(device_id)
    return known.memory_gib if known else None


GPU_NAMES = ", ".join(m.name for m in GPU_MODELS)

# --- llm-scaler images --------------------------------------------------------------------

# sym_int4's device bytes per linear weight element (4 bits, fp16 scale per group of 128,
# padding): one layout, or two in 0.21.0-b1 (ESIMD + transposed oneDNN copy), as worked out
# from the module (research PUBLIC-RECORD, "Intel's sym_int4").
ONE_LAYOUT = 0.535
TWO_LAYOUTS = 1.035
OFFLOAD = "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT"
Q40_LIB = "VLLM_QUANTIZE_Q40_LIB"


@dataclass(frozen=True)
class Image:
    tag: str  # the part after "intel/llm-scaler-vllm:"
    source: str
    # The sym_int4 load: "legacy" (whole 16-bit shard on the host: the module reads
    # VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT and the Dockerfile sets it), "layerwise".
    load: str
    int4_bytes_per_weight: float
    int4_layout: str
    env: dict[str, str] = field(default_factory=dict)
    compute_runtime: str | None = None
    compute_runtime_source: str = "not known to doctor"
    # True where the runtime is inferred (no thread or file of the image shows it).
    compute_runtime_inferred: bool = False

    @property
    def duplicate_layout(self) -> bool:
        return self.int4_bytes_per_weight > ONE_LAYOUT

    @property
    def ipex_gptq_moe(self) -> bool:
        """Whether the image's GPTQ MoE layers run IPEX's ``GatedMLPMOE``."""
        return self.tag in IPEX_GPTQ_MOE


# The images whose vllm_for_multi_arc.patch adds XPUGPTQMarlinMoEMethod to ipex_quant.py,
# which builds an ipex.llm.modules.GatedMLPMOE for each GPTQ MoE layer (tags vllm-0.10.2-b6,
# vllm-1.3 (image 0.11.1-b7), vllm-0.14.0-b8.2, -b8.2.1, -b8.3); upstream vLLM builds one
# only for FP8 MoE, and the 0.21 and 0.26 patches build none.
IPEX_GPTQ_MOE = frozenset({"0.10.2-b6", "0.11.1-b7", "0.14.0-b8.2", "0.14.0-b8.2.1", "0.14.0-b8.3"})
# llm-scaler #348 (a maintainer, 2026-04-27): GatedMLPMOE takes about 400 MB more in the
# first forward pass of each layer (Qwen3.5-35B-A3B-GPTQ-Int4 on one card: TP 2 needed).
# Whether each layer keeps it is not said, so from one layer's to every layer's.
IPEX_MOE_FIRST_FORWARD = 400 * 2**20


# What the Dockerfiles set (llm-scaler tags, vllm/docker/Dockerfile ENV lines, read in
# docs/research/intel-images-and-driver.md, table A.2). No tag sets a driver debug key.
# Every vllm/docker/Dockerfile in the repository sets VLLM_QUANTIZE_Q40_LIB (every tag from
# vllm-0.2.0-b2 on, and all 70 branches that have the file); the 0.10-0.14 ones set
# VLLM_WORKER_MULTIPROC_METHOD=spawn in their vllm-base stage, which the served stage
# inherits (FROM vllm-base), as the 0.21 ones do in their own ENV.
_LIB_010 = "/usr/local/lib/python3.12/dist-packages/vllm_int4_for_multi_arc.so"
_LIB_021 = "/opt/venv/lib/python3.12/site-packages/vllm_int4_for_multi_arc.so"
_SET_010 = {
    Q40_LIB: _LIB_010,
    OFFLOAD: "1",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
}
_SET_010_B6 = {**_SET_010, "UR_L0_USE_IMMEDIATE_COMMANDLISTS": "0"}
_SET_014_B82 = {**_SET_010, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
_SET_021 = {**_SET_010, Q40_LIB: _LIB_021}
# The 0.21 images' runtime base, intel/pytorch:xpu-2.11.0-ubuntu24.04, carries this
# compute-runtime (vllm/docker/Dockerfile.dev, lines 8-11, at tags vllm-0.21.0-b1 and -b2).
_RUNTIME_021 = "26.14.37833.4"
# The 0.26 images are in no snapshot. Inferred, not read: the same Dockerfile.dev says the
# omix 0.1.0 base carries that runtime, and the 0.26 dev image builds on omix 0.1.0
# (branch codex/vllm-0.26-dev-image, vllm/docker/Dockerfile.dev line 45).
_RUNTIME_026_SOURCE = "inferred: the omix 0.1.0 base's, per llm-scaler's Dockerfile.dev"
IMAGES = (
    Image(
        "0.10.0-b2",
        "llm-scaler tag vllm-0.10.0-b2 (image 1.1-preview by digest, Releases.md): "
        "vllm/docker/Dockerfile (ENV, lines 47, 115-117), vllm_for_multi_arc.patch (weights "
        "created on the CPU: the whole shard)",
        "legacy",
        ONE_LAYOUT,
        "before the 0.14 seam",
        dict(_SET_010),
        "25.27.34303",
        "llm-scaler #153: sycl-ls inside the container",
    ),
    Image(
        "0.10.2-b5",
        "llm-scaler tag vllm-0.10.2-b5: vllm/docker/Dockerfile (ENV, lines 126-128), "
        "vllm_for_multi_arc.patch (weights created on the CPU: the whole shard)",
        "legacy",
        ONE_LAYOUT,
        "before the 0.14 seam",
        dict(_SET_010),
        "25.40",
        "not recorded in the repository (an offline installer); the tag (2025-11-04) predates "
        "compute-runtime 25.44.36015.5 (2025-11-14), so 25.40 at the newest",
    ),
    Image(
        "0.10.2-b6",
        "llm-scaler tag vllm-0.10.2-b6 (image 1.2 by digest, Releases.md): "
        "vllm/docker/Dockerfile (ENV, lines 46, 126-129), vllm_for_multi_arc.patch (weights "
        "created on the CPU: the whole shard)",
        "legacy",
        ONE_LAYOUT,
        "before the 0.14 seam",
        dict(_SET_010_B6),
    ),
    Image(
        "0.11.1-b7",
        "llm-scaler image 0.11.1-b7 (image 1.3 by digest, Releases.md); tag vllm-1.3's "
        "vllm/docker/Dockerfile (ENV, lines 50, 108-110: it clones vLLM v0.11.1, where tag "
        "vllm-0.11.1-b7's clones v0.10.2), vllm_for_multi_arc.patch (the whole shard)",
        "legacy",
        ONE_LAYOUT,
        "before the 0.14 seam",
        dict(_SET_010),
        "25.40.35563",
        "llm-scaler #288: sycl-ls inside image 1.3 (Level Zero adapter 1.13.35563)",
    ),
    Image(
        "0.14.0-b8.2",
        "llm-scaler tag vllm-0.14.0-b8.2: vllm/docker/Dockerfile (ENV, lines 51, 129-131), "
        "vllm_for_multi_arc.patch (weights created on the CPU: the whole shard)",
        "legacy",
        ONE_LAYOUT,
        "before the 0.14 seam",
        dict(_SET_014_B82),
        "26.09.37435.12",
        "llm-scaler #382: sycl-ls inside the container",
    ),
    Image(
        "0.14.0-b8.2.1",
        "llm-scaler tag vllm-0.14.0-b8.2.1 (image 1.4 by digest, Releases.md): as 0.14.0-b8.2",
        "legacy",
        ONE_LAYOUT,
        "before the 0.14 seam",
        dict(_SET_014_B82),
        "26.09.37435.12",
        "llm-scaler #396: sycl-ls inside the container",
    ),
    Image(
        "0.14.0-b8.3",
        "llm-scaler tag vllm-0.14.0-b8.3: vllm/docker/Dockerfile (ENV, lines 135-137), "
        "vllm_for_multi_arc.patch (reads the variable; the image sets it)",
        "legacy",
        ONE_LAYOUT,
        "seam (0.14, b8.3 line)",
        dict(_SET_010),
    ),
    Image(
        "0.21.0-b1",
        "llm-scaler tag vllm-0.21.0-b1: vllm/docker/Dockerfile (ENV, lines 143-146), "
        "vllm_for_multi_arc.patch (layouts registered inline: weight_esimd and a "
        "transposed contiguous copy)",
        "legacy",
        TWO_LAYOUTS,
        "inline-registration (0.21 b1)",
        dict(_SET_021),
        _RUNTIME_021,
        "its base image, per vllm/docker/Dockerfile.dev at the tag",
    ),
    Image(
        "0.21.0-b2",
        "llm-scaler tag vllm-0.21.0-b2: vllm/docker/Dockerfile (ENV, lines 139-142), "
        "vllm_for_multi_arc.patch (_register_linear_int4_layouts; llm-scaler PR #589 "
        "keeps the oneDNN weight as a view of the ESIMD buffer)",
        "legacy",
        ONE_LAYOUT,
        "host-round-trip (0.21 b2)",
        dict(_SET_021),
        _RUNTIME_021,
        "its base image, per vllm/docker/Dockerfile.dev at the tag",
    ),
    Image(
        "0.21.0-b3.1",
        "llm-scaler #618 (its compute-runtime); no tag in the repository, so its module is "
        "taken to be 0.21.0-b2's",
        "legacy",
        ONE_LAYOUT,
        "host-round-trip (0.21 b2), assumed",
        dict(_SET_021),
        _RUNTIME_021,
        "llm-scaler #618, compute-runtime #968 (the image's own; #968's host had 26.27)",
    ),
    Image(
        "0.26.0-b1",
        "llm-scaler #672, #697 (no tag in the repository): the variable is set but no longer "
        "read; upstream layerwise processing (finalize_layerwise_processing)",
        "layerwise",
        ONE_LAYOUT,
        "0.26 (layerwise), assumed one layout",
        dict(_SET_021),
        _RUNTIME_021,
        _RUNTIME_026_SOURCE,
        compute_runtime_inferred=True,
    ),
    Image(
        "0.26.0-b2",
        "llm-scaler #672, #697, #703 (no tag in the repository): as 0.26.0-b1",
        "layerwise",
        ONE_LAYOUT,
        "0.26 (layerwise), assumed one layout",
        dict(_SET_021),
        _RUNTIME_021,
        _RUNTIME_026_SOURCE,
        compute_runtime_inferred=True,
    ),
)
# Tags users paste that name another row's image (the same Docker Hub digest in llm-scaler's
# Releases.md at 8d66bf9e; its README says "1.4 (or 0.14.0-b8.2.1)", "1.2, same image as
# 0.10.2-b6").
ALIASES = {
    "1.1-preview": "0.10.0-b2",
    "1.2": "0.10.2-b6",
    "1.3": "0.11.1-b7",
    "1.4": "0.14.0-b8.2.1",
}
# Tags that name no fixed image.
MOVING = {
    "latest": "moves with each push, and llm-scaler's vllm/README.md recommends a versioned "
    "tag instead of it; which image it is on a machine is not recorded: name the tag",
}
_IMAGES = {image.tag: image for image in IMAGES}
# The vLLM release each image serves: the `git clone -b vX.Y.Z .../vllm.git` of
# vllm/docker/Dockerfile at llm-scaler's tag for the image (at 8d66bf9e). Image 0.11.1-b7
# is image 1.3 by digest, whose tag's Dockerfile clones v0.11.1 (tag vllm-0.11.1-b7's clones
# v0.10.2). 0.21.0-b3.1 and the 0.26 images have no tag: 0.21.0-b3.1 is taken from its name;
# the 0.26 ones from branch codex/vllm-0.26-dev-image (vllm/docker/Dockerfile.dev,
# ARG VLLM_VERSION=v0.26.0) and llm-scaler #672.
IMAGE_VLLM = {
    "0.10.0-b2": "0.10.0",
    "0.10.2-b5": "0.10.2",
    "0.10.2-b6": "0.10.2",
    "0.11.1-b7": "0.11.1",
    "0.14.0-b8.2": "0.14.0",
    "0.14.0-b8.2.1": "0.14.0",
    "0.14.0-b8.3": "0.14.0",
    "0.21.0-b1": "0.21.0",
    "0.21.0-b2": "0.21.0",
    "0.21.0-b3.1": "0.21.0",
    "0.26.0-b1": "0.26.0",
    "0.26.0-b2": "0.26.0",
}


def image_vllm_version(name: str) -> str | None:
    """The vLLM release image ``name`` (a tag, an alias, or ``intel/llm-scaler-vllm:TAG``)
    serves; None for an image not in the table."""
    image = image_named(name)
    return None if image is None else IMAGE_VLLM[image.tag]


# The image to move to from one that keeps two layouts per int4 weight.
ONE_LAYOUT_IMAGE = "intel/llm-scaler-vllm:0.21.0-b2"


REPOSITORY = "intel/llm-scaler-vllm"
# A reference as docker reads one: [registry/]repository[:tag][@digest].
_REFERENCE = re.compile(
    r"(?:(?P<repo>[a-z0-9][a-z0-9._/-]*(?::\d+/[a-z0-9._/-]+)?):)?(?P<tag>[\w][\w.-]{0,127})"
    r"(?:@sha256:[0-9a-f]{64})?"
)


def _tag(name: str) -> str | None:
    """The tag of an Intel llm-scaler-vllm image reference (the bare tag, or with the
    repository, a registry and a digest); None for another repository: an image is Intel's
    by its repository name alone."""
    match = _REFERENCE.fullmatch(name.strip())
    if match is None:
        return None
    repo = match.group("repo")
    registry, _, path = (repo or REPOSITORY).partition("/")
    if "." not in registry and ":" not in registry and registry != "localhost":
        path = repo or REPOSITORY  # no registry: Docker Hub
    if path != REPOSITORY:
        return None
    return match.group("tag").removeprefix("vllm-")


def image_named(name: str) -> Image | None:
    """``intel/llm-scaler-vllm:0.21.0-b2`` (a registry and ``@sha256:`` digest allowed) or
    the bare tag (``0.21.0-b2``, ``vllm-0.21.0-b2``); an alias (``1.4``) gives the row of the
    image it names."""
    tag = _tag(name)
    return None if tag is None else _IMAGES.get(ALIASES.get(tag, tag))


def not_in_table(name: str) -> str:
    """Why ``name`` has no row, in a clause: another repository or a moving tag says so; any
    other lists the rows."""
    tag = _tag(name)
    if tag is None:
        return f"image {name!r} is not Intel's llm-scaler image ({REPOSITORY}:TAG, or TAG)"
    if tag in MOVING:
        return f"image {name!r} {MOVING[tag]}"
    return f"image {name!r} is not in doctor's table ({IMAGE_TAGS})"


IMAGE_TAGS = ", ".join(
    [image.tag for image in IMAGES] + [f"{alias} (= {tag})" for alias, tag in ALIASES.items()]
)
