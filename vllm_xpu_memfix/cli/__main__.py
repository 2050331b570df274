"""``python -m vllm_xpu_memfix.cli``: the same as the ``vllm-xpu-memfix`` command."""

import sys

from vllm_xpu_memfix.cli import main

sys.exit(main())
