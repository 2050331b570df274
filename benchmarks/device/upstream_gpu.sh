#!/usr/bin/env bash
# On the CUDA machine: the upstream series (0001, 0002, 0005) on vLLM 0.34.0's Python, its
# CUDA platform: the patches' tests (not the LLM ones, which need compiled kernels) on the
# patched tree and on plain 0.34.0, then benchmarks/device/upstream_load_host.py.
# Expects, in the git-ignored .device/up54/ (carried): whl/ (cp312 wheels of vLLM 0.34's
# import-time dependencies the image lacks, as README.md here downloads them, plus loguru,
# compressed-tensors, oss-harmony, anthropic, llguidance, xgrammar, apache-tvm-ffi, orjson,
# tblib), series.tar.gz (vllm/ and tests/ of v0.34.0 with docs/upstream/patches applied),
# plain.tar.gz (vllm/ of v0.34.0), this script, upstream_load_host.py,
# upstream_gpu_conftest.py, and libtcmalloc_minimal.so.4 for the tcmalloc row.
# TESTS_ONLY=1 skips the measurements. Results land in $OUT.
set -u
D=$PWD/.device/up54
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_PLUGINS= PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $D/whl/*.whl || exit 4
rm -f /tmp/site/sitecustomize.py
for t in patched plain; do
  rm -rf /tmp/$t && mkdir -p /tmp/$t && tar xzf $D/$( [ $t = patched ] && echo series || echo plain ).tar.gz -C /tmp/$t
  mkdir -p /tmp/$t/vllm-0.34.0.dist-info && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n' > /tmp/$t/vllm-0.34.0.dist-info/METADATA
  : > /tmp/$t/vllm/_C_stable_libtorch.py; cp $D/upstream_gpu_conftest.py /tmp/$t/conftest.py; printf '[pytest]\n' > /tmp/$t/pytest.ini
done
cp -r /tmp/patched/tests /tmp/plain/
python3 -c "import sys,torch,transformers;print(sys.version.split()[0],'torch',torch.__version__,'transformers',transformers.__version__)" >> $OUT/env.txt
OWN="tests/model_executor/model_loader/test_parallel_loading.py tests/model_executor/model_loader/test_trim_host_heap.py tests/model_executor/model_loader/test_drop_checkpoint_page_cache.py"
(cd /tmp/patched && PYTHONPATH=/tmp/patched:/tmp/site timeout 200 python3 -m pytest -q -rA -p no:cacheprovider -k "not test_llm_" $OWN > $OUT/own-patched.log 2>&1; echo "rc=$?" >> $OUT/own-patched.log) &
(cd /tmp/plain && PYTHONPATH=/tmp/plain:/tmp/site timeout 200 python3 -m pytest -q -rA -p no:cacheprovider -k "not test_llm_" $OWN > $OUT/own-plain.log 2>&1; echo "rc=$?" >> $OUT/own-plain.log) &
# Measurements: vLLM's weight readers of the patched tree, two ranks on the one GPU.
mkdir -p /tmp/standins && printf 'import sys\nsys.path.insert(0, "/tmp/patched")\nimport conftest\n' > /tmp/standins/sitecustomize.py
B="python3 $D/upstream_load_host.py"
export PYTHONPATH=/tmp/standins:/tmp/patched:/tmp/site
[ -z "${TESTS_ONLY:-}" ] && $B make /tmp/ck 2 > $OUT/load-host.log 2>&1
if [ -z "${TESTS_ONLY:-}" ]; then for fmt in bin st; do for slots in 2 1; do $B ranks /tmp/ck $fmt cuda $slots 2 >> $OUT/load-host.jsonl 2>>$OUT/load-host.log; done; done
LD_PRELOAD=$D/libtcmalloc_minimal.so.4 $B ranks /tmp/ck bin cuda 2 2 >> $OUT/load-host.jsonl 2>>$OUT/load-host.log; fi
wait
for f in $OUT/*.log; do echo "== $f"; tail -n 4 $f; done; cat $OUT/load-host.jsonl
