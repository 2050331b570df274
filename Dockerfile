# vllm-xpu-memfix layered on Intel's vLLM serving image. Build the wheel, then the image:
#   make wheel
#   docker build --build-arg IMAGE=intel/llm-scaler-vllm:0.26.0-b2 -t vllm-memfix .
# The entry point stays the image's own: llm-scaler's vllm/docker/Dockerfile (main at
# 023e157, last line) sources oneAPI's and oneCCL's environment, then runs `vllm serve`
# with the arguments after the image's name. The plugin loads in every vLLM process:
#   docker run -d --name llm --device /dev/dri --shm-size 32g -p 8000:8000 \
#     -v memfix-ledger:/ledger -e VLLM_XPU_MEMFIX_LEDGER_DIR=/ledger vllm-memfix MODEL -tp 2
# --device /dev/dri: the GPUs; --shm-size: vLLM's workers share tensors through /dev/shm
# (larger than Docker's default); the volume keeps the ledger (docs/ledger.md) for `report`.
# The plugin's own commands need --entrypoint (else they become `vllm serve`'s arguments),
# or docker exec in the running container; they read files, so no oneAPI environment:
#   docker run --rm --device /dev/dri --entrypoint vllm-xpu-memfix vllm-memfix check
#   docker run --rm --device /dev/dri -v memfix-ledger:/ledger \
#     --entrypoint vllm-xpu-memfix vllm-memfix report --ledger /ledger
#   docker exec llm vllm-xpu-memfix report --ledger /ledger
# tests/test_release.py runs these command lines' arguments through the plugin's parser.
ARG IMAGE=intel/llm-scaler-vllm:0.26.0-b2
FROM ${IMAGE}

# Where the image's vLLM and torch live: llm-scaler's vllm/docker/Dockerfile (tag
# vllm-0.21.0-b2, branches main at 8d66bf9 and codex/vllm-0.26-dev-image at 4548a64; the 0.26
# release images have no tag there) builds its serving stage FROM
# intel/pytorch:xpu-2.11.0-ubuntu24.04 (L127), whose venv /opt/venv is first on PATH (L135)
# and holds vLLM, torch and the sym_int4 library (python3.12/site-packages, L139).
ARG PYTHON=/opt/venv/bin/python

# --no-deps: nothing here may replace the image's vLLM or torch. The plugin's own
# dependencies (pyproject.toml) are named instead; pip skips those the image already has.
# tests/test_release.py runs this same step against the test bed's Python.
COPY dist/vllm_xpu_memfix-*-py3-none-any.whl /tmp/
RUN ${PYTHON} -m pip install --no-cache-dir --no-deps /tmp/vllm_xpu_memfix-*-py3-none-any.whl "psutil>=5.9" "wrapt>=1.16" "tomli>=1.1; python_version<'3.11'" \
    && ${PYTHON} -m vllm_xpu_memfix.cli --version \
    && rm /tmp/vllm_xpu_memfix-*-py3-none-any.whl
