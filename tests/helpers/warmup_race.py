"""Run the real, plugin-wrapped ``qwen_triton_warmup`` in N forked processes at one moment.

Prints a JSON list of [start, end] intervals. The runner's ``device`` attribute marks
the start and sleeps; ``compilation_config`` marks the end, as the real function
reads them in that order. Plugin settings come from the environment.
"""

import json
import multiprocessing as mp
import sys
import time
from types import SimpleNamespace

import vllm.model_executor.warmup.kernel_warmup as kernel_warmup

import vllm_xpu_memfix

HOLD_S = 0.6


class RecordingRunner:
    def __init__(self, queue):
        self.queue = queue
        self.start = None

    @property
    def device(self):
        self.start = time.time()
        time.sleep(HOLD_S)
        return "cpu"

    @property
    def compilation_config(self):
        self.queue.put([self.start, time.time()])
        return SimpleNamespace(static_forward_context={})

    max_num_tokens = 8
    is_pooling_model = False


def child(queue, go_at):
    config = SimpleNamespace(
        hf_text_config=SimpleNamespace(model_type="qwen3_5_text"),
        hf_config=SimpleNamespace(model_type="qwen3_5_text"),
        dtype=None,
    )
    time.sleep(max(0.0, go_at - time.time()))
    kernel_warmup.qwen_triton_warmup(RecordingRunner(queue), config)


if __name__ == "__main__":
    vllm_xpu_memfix.register()
    count = int(sys.argv[1])
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    go_at = time.time() + 0.5
    procs = [ctx.Process(target=child, args=(queue, go_at)) for _ in range(count)]
    for p in procs:
        p.start()
    intervals = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    print(json.dumps(intervals))
