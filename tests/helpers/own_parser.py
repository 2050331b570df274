"""doctor with its own serve-line parser, as where no vLLM is installed (issue 51).

The test bed has vLLM, so doctor reads a pasted line with vLLM's parser and configuration
(``cli.doctor.vllmline``, held by tests/test_doctor_vllm_line.py). The tests of doctor's
own parser run doctor as it runs without vLLM: ``vllmline.installed`` answering None.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest

# ``python -m vllm_xpu_memfix.cli`` with the installed vLLM's version unknown to doctor.
COMMAND = [
    sys.executable,
    "-c",
    "import sys; from vllm_xpu_memfix.cli.doctor import vllmline; "
    "vllmline.installed = lambda: None; from vllm_xpu_memfix.cli import main; sys.exit(main())",
]


@contextlib.contextmanager
def own_parser() -> Iterator[None]:
    """In this process: doctor's own parser, as without vLLM."""
    from vllm_xpu_memfix.cli.doctor import vllmline

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllmline, "installed", lambda: None)
        yield
