#!/usr/bin/env bash
# On the CUDA machine: vLLM 0.34.0's Python with the series applied, the series' tests and
# vLLM's own tests of the touched modules, and the same vLLM tests on the unpatched copy.
# Expects, in the git-ignored .device/ (carried): whl034/ (cp312 wheels of vLLM 0.34's
# import-time and test dependencies the image lacks, as README.md here downloads them, plus
# orjson and tblib), and up48/: vllm034-patched.tar.xz (vllm/*.py of the patched copy that
# scripts/upstream_check.py builds), vllm034-data.tar.gz (the release's non-.py files from
# .cache/upstream/vllm-0.34.0), vllm-tests.tar.gz (tests/ of the patched copy: the series'
# tests and vLLM's own, from its sdist), series/ (docs/upstream/patches/000*.patch).
# Results land in $OUT: env.txt and one pytest log per run.
set -u
REPO=$PWD D=$PWD/.device
test -d "$D/up48" || { echo "no .device/up48 in $PWD"; exit 3; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_PLUGINS= PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $D/whl034/*.whl || exit 4
rm -rf /tmp/patched /tmp/plain && mkdir -p /tmp/patched && cd /tmp/patched
tar xJf $D/up48/vllm034-patched.tar.xz && tar xzf $D/up48/vllm034-data.tar.gz && tar xzf $D/up48/vllm-tests.tar.gz
# Stand-ins (as benchmarks/device/README.md): a version record so vLLM picks the CUDA
# platform, an empty compiled module the CUDA platform imports; vLLM's tests/conftest.py
# (which needs its test requirements) replaced by benchmarks/device/upstream_gpu_conftest.py.
mkdir -p vllm-0.34.0.dist-info && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n' > vllm-0.34.0.dist-info/METADATA
: > vllm/_C_stable_libtorch.py; cp "$REPO/benchmarks/device/upstream_gpu_conftest.py" tests/conftest.py; printf '[pytest]\n' > pytest.ini
cp -r /tmp/patched /tmp/plain
(cd /tmp/plain && for p in $(ls -r $D/up48/series/*.patch); do git apply -R "$p" || echo "REVERSE FAILED $p"; done)
python3 -c "import torch,transformers,sys;print(sys.version.split()[0],'torch',torch.__version__,'transformers',transformers.__version__)" >> $OUT/env.txt
PT="python3 -m pytest -q -rA -p no:cacheprovider -p no:randomly"
OWN="tests/model_executor/model_loader/test_parallel_loading.py tests/model_executor/model_loader/test_host_memory.py tests/model_executor/model_loader/test_drop_checkpoint_page_cache.py tests/v1/worker/test_sampler_headroom.py tests/model_executor/test_warmup_turn.py"
EXISTING="tests/v1/worker/test_gpu_worker.py tests/model_executor/model_loader/test_registry.py tests/model_executor/test_jit_warmup.py tests/model_executor/test_attention_warmup.py tests/engine/test_arg_utils.py"
(cd /tmp/patched && PYTHONPATH=/tmp/patched:/tmp/site timeout 200 $PT $OWN > $OUT/own-patched.log 2>&1; echo "rc=$?" >> $OUT/own-patched.log) &
(cd /tmp/patched && PYTHONPATH=/tmp/patched:/tmp/site timeout 240 $PT $EXISTING > $OUT/existing-patched.log 2>&1; echo "rc=$?" >> $OUT/existing-patched.log) &
(cd /tmp/plain && PYTHONPATH=/tmp/plain:/tmp/site timeout 240 $PT $EXISTING > $OUT/existing-plain.log 2>&1; echo "rc=$?" >> $OUT/existing-plain.log) &
wait
cd /tmp/patched && for f in $OUT/*.log; do echo "== $f"; tail -n 3 $f; done
