"""Measured device burst of vLLM's logits + sampler warm-up against the plugin's estimate.

Runs on a CUDA machine with vLLM's Python sources on PYTHONPATH (see
benchmarks/device/README.md). For each dtype, vocabulary V, batch B and
top-k/top-p implementation it runs vLLM's own ``GPUModelRunner._dummy_sampler_run``
(unbound, on a stand-in runner that carries vLLM's real ``Sampler``) over a model
stand-in whose ``compute_logits`` is vLLM's ``LogitsProcessor`` on an lm_head
weight of V rows. A first call plays the profile run (it fills Triton's caches);
the second is measured, as the post-KV warm-up would be:

- torch: ``max_memory_allocated()`` above the allocated bytes before the call;
- driver: ``mem_get_info()`` free bytes before minus after (the cache is emptied
  before, so this is what the call made the allocator and the driver take).

"sort" forces ``apply_top_k_top_p_pytorch`` (vLLM's path where Triton is missing)
by clearing ``topk_topp_sampler.HAS_TRITON``; "triton" is the default path.

``--tp N`` measures one rank of tensor parallelism N on the one GPU: the lm_head
is this rank's shard of the padded vocabulary, and its logits go through vLLM's
own ``DeviceCommunicatorBase.all_gather`` (which XPU's communicator inherits)
and the vocabulary slice. Only the collective itself is a stand-in: it fills the
output with this rank's shard in place, allocating nothing, so the figure is
torch's part of the burst; NCCL's or oneCCL's own buffers are what the slack is for.

    python benchmarks/kv_headroom_device.py --out DIR [--tp 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # no FlashInfer on the machine

import torch
import torch.nn.functional as F

from vllm_xpu_memfix.memory.estimate import (
    BurstShape,
    dtype_bytes,
    estimate_sampler_burst,
    pad_vocab,
)

MiB = 1024**2
HIDDEN = 2048
BATCHES = (1, 8, 64, 256, 1024)
VOCABS = (32000, 151936, 248320)
DTYPES = ("float16", "bfloat16")
PATHS = ("triton", "sort")


def sampler_run():
    """vLLM's own _dummy_sampler_run; where its module cannot import, the same two calls."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner._dummy_sampler_run, "vllm GPUModelRunner._dummy_sampler_run"
    except Exception as exc:  # the CUDA runner imports compiled extensions
        reason = f"{type(exc).__name__}: {exc}"
    from dataclasses import replace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    def two_sampler_calls(runner, hidden):
        logits = runner.model.compute_logits(torch.rand_like(hidden))
        rows = logits.size(0)

        def full(value):
            return torch.full((rows,), value, device=runner.device)

        metadata = SamplingMetadata(
            temperature=full(0.5),
            all_greedy=False,
            all_random=False,
            top_p=full(0.9),
            top_k=full(logits.size(1) - 1),
            generators={},
            max_num_logprobs=None,
            logprob_token_ids=None,
            no_penalties=True,
            prompt_token_ids=None,
            frequency_penalties=full(0.1),
            presence_penalties=full(0.1),
            repetition_penalties=full(0.1),
            output_token_ids=[[] for _ in range(rows)],
            spec_token_ids=[[] for _ in range(rows)],
            allowed_token_ids_mask=None,
            bad_words_token_ids={},
            logitsprocs=LogitsProcessors(),
        )
        output = runner.sampler(logits=logits, sampling_metadata=metadata)
        seeded = {0: torch.Generator(device=runner.device).manual_seed(0)}
        runner.sampler(logits=logits, sampling_metadata=replace(metadata, generators=seeded))
        return output

    return two_sampler_calls, f"same two Sampler calls as _dummy_sampler_run ({reason})"


def stand_in_runner(weight: torch.Tensor, vocab: int, device: torch.device):
    from vllm.v1.sample.sampler import Sampler

    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        with set_current_vllm_config(VllmConfig()):
            processor = LogitsProcessor(vocab)
        lm_head = SimpleNamespace(
            tp_size=1,
            weight=weight,
            quant_method=SimpleNamespace(
                apply=lambda layer, x, bias=None: F.linear(x, layer.weight, bias)
            ),
        )
        logits, via = (lambda hidden: processor(lm_head, hidden)), "vLLM LogitsProcessor"
    except Exception as exc:  # its import chain needs vLLM's compiled ops
        logits = lambda hidden: F.linear(hidden, weight)[..., :vocab]  # noqa: E731
        via = f"F.linear + vocab slice, as LogitsProcessor at TP 1 ({type(exc).__name__})"
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(multimodal_config=None)),
        model=SimpleNamespace(compute_logits=logits),
        device=device,
        sampler=Sampler(),
        speculative_config=None,
    )
    return runner, via


def tp_runner(weight: torch.Tensor, vocab: int, tp: int, device: torch.device):
    """A runner whose logits are one rank's shard, gathered by vLLM's all_gather."""
    import torch.distributed as dist
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )

    def fill_from_this_rank(output, input_, group=None):
        output.view(tp, *input_.shape).copy_(input_.expand(tp, *input_.shape))

    dist.all_gather_into_tensor = fill_from_this_rank
    shard = weight[: pad_vocab(vocab) // tp]
    communicator = SimpleNamespace(world_size=tp, device_group=None)

    def logits(hidden):
        gathered = DeviceCommunicatorBase.all_gather(communicator, F.linear(hidden, shard), -1)
        return gathered[..., :vocab]

    runner, _ = stand_in_runner(weight, vocab, device)
    runner.model = SimpleNamespace(compute_logits=logits)
    return runner, f"rank shard + vLLM DeviceCommunicatorBase.all_gather (TP {tp})"


def measure(run, runner, hidden: torch.Tensor) -> dict[str, int]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    free_before = torch.cuda.mem_get_info()[0]
    torch.cuda.reset_peak_memory_stats()
    run(runner, hidden)
    torch.cuda.synchronize()
    return {
        "torch_peak": torch.cuda.max_memory_allocated() - base,
        "reserved_growth": torch.cuda.max_memory_reserved() - reserved,
        "driver_delta": free_before - torch.cuda.mem_get_info()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1, help="measure one rank of this TP size")
    args = parser.parse_args()
    dtypes, vocabs = (DTYPES, VOCABS) if args.tp == 1 else (("bfloat16",), VOCABS[1:])
    args.out.mkdir(parents=True, exist_ok=True)

    from vllm.v1.sample.ops import topk_topp_sampler

    run, via = sampler_run()
    device = torch.device("cuda")
    torch.ones(1, device=device)
    rows = []
    cold = None
    logits_via = ""
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for vocab in vocabs:
            weight = torch.randn(vocab, HIDDEN, dtype=dtype, device=device) * 0.02
            for path in PATHS:
                topk_topp_sampler.HAS_TRITON = path == "triton"
                if args.tp == 1:
                    runner, logits_via = stand_in_runner(weight, vocab, device)
                else:
                    runner, logits_via = tp_runner(weight, vocab, args.tp, device)
                for batch in BATCHES:
                    hidden = torch.randn(batch, HIDDEN, dtype=dtype, device=device)
                    first = measure(run, runner, hidden)  # the profile run's call
                    if cold is None:
                        cold = first
                    samples = [measure(run, runner, hidden) for _ in range(args.repeats)]
                    shape = BurstShape(batch, vocab, dtype_bytes(dtype), args.tp, HIDDEN, path)
                    estimate = estimate_sampler_burst(shape)
                    row = {
                        "dtype": dtype_name,
                        "vocab": vocab,
                        "batch": batch,
                        "path": path,
                        "estimate": estimate.peak,
                        "estimate_stage": estimate.peak_stage.name,
                        **{k: int(statistics.median(s[k] for s in samples)) for k in samples[0]},
                    }
                    row["ratio"] = row["estimate"] / max(row["torch_peak"], 1)
                    rows.append(row)
                    print(
                        f"{dtype_name} V={vocab} B={batch} {path}: measured "
                        f"{row['torch_peak'] / MiB:.1f} MiB, estimate/measured {row['ratio']:.3f}",
                        flush=True,
                    )
                    del hidden
            del weight
    result = {
        "tp": args.tp,
        "via": via,
        "logits_via": logits_via,
        "stand_ins": "runner = namespace carrying vLLM's Sampler; lm_head = a weight of V rows",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "hidden": HIDDEN,
        "repeats": args.repeats,
        "cold_first_call": cold,
        "rows": rows,
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    name = "kv_headroom_device.json" if args.tp == 1 else f"kv_headroom_device-tp{args.tp}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    bad = [r for r in rows if not (r["torch_peak"] <= r["estimate"] <= 1.25 * r["torch_peak"])]
    within = len(rows) - len(bad)
    print(f"{within}/{len(rows)} shapes within measured <= estimate <= 1.25 x measured")


if __name__ == "__main__":
    main()
