"""Run the real, plugin-wrapped ``qwen_triton_warmup`` in forked processes at one moment.

One process imports vLLM once, then serves races, one a line: a JSON request on stdin,
``{"env": {...}, "engines": E, "ranks": N}``. For each it forks E engine processes; each
takes the request's plugin variables, registers the plugin and forks N ranks, which call
the warm-up at one moment. The answer is one JSON line on stdout: each engine's list of
[start, end] intervals, or ``{"error": ...}``. The runner's ``device`` attribute marks the
start and sleeps; ``compilation_config`` marks the end, as the real function reads them
in that order. Forking after the import spares each race vLLM's import (seconds of CPU).
"""

import json
import multiprocessing as mp
import os
import queue as queues
import sys
import time
from types import SimpleNamespace

import vllm.model_executor.warmup.kernel_warmup as kernel_warmup

import vllm_xpu_memfix

HOLD_S = 0.6
RESULT_S = 60  # a rank stuck behind a lock that never frees ends the race here


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


def rank(queue, go_at):
    config = SimpleNamespace(
        hf_text_config=SimpleNamespace(model_type="qwen3_5_text"),
        hf_config=SimpleNamespace(model_type="qwen3_5_text"),
        dtype=None,
    )
    time.sleep(max(0.0, go_at - time.time()))
    kernel_warmup.qwen_triton_warmup(RecordingRunner(queue), config)


def engine(index, env, ranks, go_at, results):
    for name in [n for n in os.environ if n.startswith("VLLM_XPU_MEMFIX")]:
        del os.environ[name]
    os.environ.update(env)
    vllm_xpu_memfix.register()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank, args=(queue, go_at)) for _ in range(ranks)]
    for p in procs:
        p.start()
    intervals = [queue.get(timeout=RESULT_S) for _ in procs]
    for p in procs:
        p.join()
    results.put((index, intervals))


def race(request):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    go_at = time.time() + 1.0  # every engine forks and registers before its ranks go
    args = (request["env"], request["ranks"], go_at, results)
    procs = [ctx.Process(target=engine, args=(i, *args)) for i in range(request["engines"])]
    for p in procs:
        p.start()
    found = {}
    try:
        for _ in procs:
            index, intervals = results.get(timeout=RESULT_S + 30)
            found[index] = intervals
    except queues.Empty:
        codes = [p.exitcode for p in procs]
        for p in procs:
            p.kill()
        return {"error": f"not every engine answered (exit codes {codes})"}
    for p in procs:
        p.join()
    return [found[i] for i in range(len(procs))]


if __name__ == "__main__":
    # The parent stays unregistered: each engine registers with its own request's settings.
    assert not vllm_xpu_memfix._registered, "vLLM's import registered the plugin"
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        print(json.dumps(race(json.loads(line))), flush=True)
