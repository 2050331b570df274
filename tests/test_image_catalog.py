"""The llm-scaler image table: the tags users paste, what every Dockerfile sets, and a
runtime that is inferred rather than read (docs/research/intel-images-and-driver.md)."""

from __future__ import annotations

import pytest

from vllm_xpu_memfix.cli.doctor import hostfile
from vllm_xpu_memfix.intel import catalog

# Pairs with one Docker Hub digest in llm-scaler's Releases.md (main, 8d66bf9e).
SAME_DIGEST = {
    "1.1-preview": "0.10.0-b2",  # sha256:07b8f4c2...
    "1.2": "0.10.2-b6",  # sha256:2dcce842...
    "1.3": "0.11.1-b7",  # sha256:02d5f2c9...
    "1.4": "0.14.0-b8.2.1",  # sha256:e96ac887...
}


@pytest.mark.parametrize(("alias", "tag"), sorted(SAME_DIGEST.items()))
def test_a_numeric_tag_gives_the_row_of_the_image_with_its_digest(alias, tag):
    for name in (f"intel/llm-scaler-vllm:{alias}", alias, f"vllm-{alias}"):
        image = catalog.image_named(name)
        assert image is not None and image.tag == tag, name


def test_latest_is_named_as_a_moving_tag_not_as_an_unknown_image():
    assert catalog.image_named("intel/llm-scaler-vllm:latest") is None
    note = catalog.not_in_table("intel/llm-scaler-vllm:latest")
    assert "moves" in note and "name the tag" in note
    assert "is not in doctor's table" in catalog.not_in_table("intel/llm-scaler-vllm:9.9")


@pytest.mark.parametrize("image", catalog.IMAGES, ids=lambda image: image.tag)
def test_every_image_sets_the_library_path_the_legacy_load_and_spawn(image):
    assert image.env[catalog.Q40_LIB].endswith("/vllm_int4_for_multi_arc.so")
    assert image.env[catalog.OFFLOAD] == "1"
    assert image.env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def parsed(text: str) -> hostfile.Described:
    tomllib = pytest.importorskip("tomllib")
    return hostfile.parse(tomllib.loads(text), "h.toml")


GPUS = '[[gpu]]\nmodel = "Arc Pro B70"\ncount = 2\n'


def test_an_inferred_runtime_is_used_and_said_to_be_inferred():
    described = parsed(f'{GPUS}[image]\nname = "intel/llm-scaler-vllm:0.26.0-b2"\n')
    assert described.runtime is not None and described.runtime.version == "26.14.37833.4"
    assert any("26.14.37833.4" in a and "inferred" in a for a in described.assumed)
    read = parsed(f'{GPUS}[image]\nname = "intel/llm-scaler-vllm:0.21.0-b2"\n')
    assert read.runtime is not None and not any("inferred" in a for a in read.assumed)


def test_a_pasted_alias_brings_its_images_runtime_and_latest_says_why_it_cannot():
    described = parsed(f'{GPUS}[image]\nname = "intel/llm-scaler-vllm:1.4"\n')
    assert described.image is not None and described.image.tag == "0.14.0-b8.2.1"
    assert described.runtime is not None and described.runtime.version == "26.09.37435.12"
    latest = parsed(f'{GPUS}[image]\nname = "intel/llm-scaler-vllm:latest"\n')
    assert latest.image is None and any("name the tag" in a for a in latest.assumed)
