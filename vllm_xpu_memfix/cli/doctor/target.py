"""What doctor judges a line for: the image, the vLLM release and the platform.

The image is one input, spelled ``--image TAG`` or a host file's ``[image] name``: both
are read here, and what an image brings (the variables its Dockerfile sets, its
compute-runtime, its sym_int4's load) is applied by these functions alone, to a described
machine (``hostfile``) and to this one (``facts``) alike. A value given in both places
must agree.

The platform is ``xpu`` for an image or a host file with Intel GPUs, ``cpu`` for a host
file without one, and None for this machine (whatever vLLM resolves here is this machine's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vllm_xpu_memfix.intel import catalog, driver
from vllm_xpu_memfix.startup.host import OFFLOAD

XPU, CPU = "xpu", "cpu"


class ImageError(ValueError):
    """An image doctor cannot take; the message is one line."""


def image_of(flag: str | None, host_name: str | None) -> str | None:
    """The one image name: ``--image``'s or the host file's; both must agree."""
    if flag and host_name and catalog.image_named(flag) != catalog.image_named(host_name):
        raise ImageError(
            f"--image {flag!r} and the host file's [image] name {host_name!r} differ; "
            "give it in one place"
        )
    return flag or host_name


def environment(image: catalog.Image | None, given: Mapping[str, str]) -> dict[str, str]:
    """The serving processes' variables: what the image's Dockerfile sets, then ``given``
    (the host file's ``[env]``, or this process's environment), which wins."""
    return {**(image.env if image else {}), **given}


def runtime(
    image: catalog.Image | None, given: driver.Runtime | None
) -> tuple[driver.Runtime | None, str | None]:
    """The compute-runtime: ``given`` wins, else the image's; and what was inferred."""
    if given is not None or image is None or not image.compute_runtime:
        return given, None
    found = driver.runtime_from_version(
        image.compute_runtime, f"image {image.tag} ({image.compute_runtime_source})"
    )
    if not image.compute_runtime_inferred:
        return found, None
    return found, (
        f"compute-runtime {image.compute_runtime} for image {image.tag}: inferred, "
        "not read from the image ([driver] compute_runtime wins)"
    )


def legacy(env: Mapping[str, str], image: catalog.Image | None) -> tuple[bool, str]:
    """Whether the image's sym_int4 buffers each rank's whole 16-bit shard on the host."""
    if env.get(OFFLOAD) != "1":
        return False, f"{OFFLOAD} unset: one layer in flight"
    if image is None:
        return True, (
            f"{OFFLOAD}=1 and no known image: taken as the legacy load (the whole "
            "16-bit shard on the host)"
        )
    if image.load != "legacy":
        return False, f"{OFFLOAD}=1 is stale: image {image.tag}'s sym_int4 never reads it"
    return True, f"{OFFLOAD}=1: image {image.tag}'s sym_int4 holds the whole 16-bit shard"


def layouts(image: catalog.Image) -> tuple[int, str]:
    """Device layouts per sym_int4 weight of the image's module, and whose."""
    return (2 if image.duplicate_layout else 1), f"image {image.tag}: {image.int4_layout}"


@dataclass(frozen=True)
class Target:
    """The release and platform a line is judged for."""

    vllm: str | None  # None: the installed vLLM's
    platform: str | None  # None: whatever vLLM resolves on this machine

    def answers_here(self, gpus_here: bool) -> bool:
        """Whether the vLLM installed here can resolve the platform judged for: an XPU
        platform only where this machine has an Intel GPU."""
        return self.platform != XPU or gpus_here


def target(image: catalog.Image | None, host_gpus: int | None) -> Target:
    """``host_gpus``: the Intel GPUs of the host file's machine; None for this machine."""
    release = None if image is None else catalog.IMAGE_VLLM[image.tag]
    if image is not None or host_gpus:
        return Target(release, XPU)
    return Target(release, None if host_gpus is None else CPU)
