"""One voice: doctor (a serve line read by vLLM's parser and configuration, as doctor reads
it where vLLM is installed, and a described machine, ``--host``) and the preflight
(vLLM's own ``create_engine_config`` in-process, the same machine as a sysroot tree) give
the same verdict, failing phase and side, and main cause over a corpus of lines and
machines (issue 46, item 5).

The test bed runs vLLM's CPU build, so some of what vLLM resolves differs from an XPU
host; those values are pinned on the line for both, and said here:
- the KV cache: the CPU platform sets ``kv_cache_memory_bytes`` from
  ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB here), so the line gives ``--kv-cache-memory-bytes 1G``;
- the scheduler: the CPU platform's 2048 batched tokens (the XPU default: 8192) and its
  max_num_seqs, so the line gives both;
- the platform: no Intel GPU can run here, so the preflight takes vLLM's platform for XPU
  (``test_preflight.engine_config``), the GPUs read from the sysroot;
- sym_int4: Intel's images register it; here the project's replay of it
  (tests/plugins/sym_int4_replay) is registered, and the preflight reads its source as
  the installed module, whose 0.21 load reads ``VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib
from hosts import B60, B70, add_igpu, build_host
from test_preflight import Records, capture, engine_config, sparse_27b

from vllm_xpu_memfix.cli import doctor
from vllm_xpu_memfix.cli.doctor import described, hostfile, vllmline
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import catalog
from vllm_xpu_memfix.startup import host
from vllm_xpu_memfix.startup.sizing import ServeArgs

pytest.importorskip("vllm")

PINNED = ("--dtype", "bfloat16", "--kv-cache-memory-bytes", "1G",
          "--max-num-batched-tokens", "8192", "--max-num-seqs", "256")  # fmt: skip
PINNED_ARGS = {"dtype": "bfloat16", "max_num_batched_tokens": 8192, "max_num_seqs": 256}
RUNTIME = "26.14.37833.4"


@dataclass(frozen=True)
class Machine:
    """One machine, written twice: a host file for doctor, a sysroot for the preflight."""

    gpus: tuple[tuple[int, int], ...]
    vram_gib: int = 32  # the discrete GPUs' (a B60's 24 GiB, as the product table says)
    igpu: bool = False
    available_gib: int = 120
    image: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def host_file(self) -> str:
        kinds: dict[tuple[int, int], int] = {}
        for gpu in self.gpus:
            kinds[gpu] = kinds.get(gpu, 0) + 1
        text = f"[host]\nram_gib = 128\navailable_gib = {self.available_gib}\nswap_gib = 0\n"
        text += 'kernel = "7.1.8"\n'
        for (_, device), count in kinds.items():
            text += f'\n[[gpu]]\npci_id = "0x{device:04x}"\ncount = {count}\n'
        if self.igpu:
            # After the discrete GPUs, in Level Zero's order. Its memory is the host's, not
            # in sysfs: the preflight judges the smallest device it knows, so the file
            # gives the iGPU the discrete GPU's size (a host file must give one).
            text += f'\n[[gpu]]\npci_id = "0xa7a0"\ncount = 1\nmemory_gib = {self.vram_gib}\n'
        text += f'\n[driver]\ncompute_runtime = "{RUNTIME}"\n'
        if self.image:
            text += f'\n[image]\nname = "{self.image}"\n'
        text += "\n[env]\n" + "".join(f'{k} = "{v}"\n' for k, v in self.env.items())
        return text + "\n[plugin]\ninstalled = true\n"

    def sysroot(self, root: Path) -> Path:
        tree = build_host(
            root,
            list(self.gpus),
            runtime=RUNTIME,
            vram_gib=self.vram_gib,
            mem_available_gib=self.available_gib,
        )
        return add_igpu(tree) if self.igpu else tree


@dataclass(frozen=True)
class Case:
    line: tuple[str, ...]
    engine_args: dict[str, object]
    machine: Machine
    config: dict[str, object] = field(default_factory=dict)  # config.json keys changed


TWO_B70 = Machine((B70, B70))
LEGACY = {"VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT": "1"}
B1, B2 = "intel/llm-scaler-vllm:0.21.0-b1", "intel/llm-scaler-vllm:0.21.0-b2"
REPLAY_LAYOUT = {B1: "0.21-b1", B2: "0.21"}  # the replay's layout of each image's sym_int4
CORPUS = {
    "27B BF16 on one B70": Case((), {}, Machine((B70,))),
    "27B TP 2 on two B70": Case(("-tp", "2"), {"tensor_parallel_size": 2}, TWO_B70),
    "FP8 on the fly, one B70": Case(("-q", "fp8"), {"quantization": "fp8"}, Machine((B70,))),
    "PP 2 on two B70": Case(("-pp", "2"), {"pipeline_parallel_size": 2}, TWO_B70),
    "PP 2 on one B70": Case(("-pp", "2"), {"pipeline_parallel_size": 2}, Machine((B70,))),
    "DP 2 on two B70": Case(("-dp", "2"), {"data_parallel_size": 2}, TWO_B70),
    "long context, TP 2": Case(
        ("-tp", "2", "--max-model-len", "131072"),
        {"tensor_parallel_size": 2, "max_model_len": 131072},
        TWO_B70,
        {"max_position_embeddings": 262144},
    ),
    "the model's own context": Case(
        ("-tp", "2"), {"tensor_parallel_size": 2}, TWO_B70, {"max_position_embeddings": 262144}
    ),
    "MXFP4 checkpoint, one B70": Case(
        (), {}, Machine((B70,)), {"quantization_config": {"quant_method": "mxfp4"}}
    ),
    "a flag not modelled, one B70": Case(
        ("--enforce-eager",), {"enforce_eager": True}, Machine((B70,))
    ),
    "a flag that could lower the load, one B70": Case(
        ("--disable-custom-all-reduce",), {"disable_custom_all_reduce": True}, Machine((B70,))
    ),
    "iGPU first in PCI order, one B60": Case((), {}, Machine((B60,), 24, igpu=True)),
    "iGPU beside a B60, TP 2": Case(
        ("-tp", "2"), {"tensor_parallel_size": 2}, Machine((B60,), 24, igpu=True)
    ),
    "legacy sym_int4 load, TP 2": Case(
        ("-tp", "2", "-q", "sym_int4"),
        {"tensor_parallel_size": 2, "quantization": "sym_int4"},
        Machine((B70, B70), image=B2, env=LEGACY, available_gib=24),
    ),
    "0.21.0-b1 layouts, one B60": Case(
        ("-q", "sym_int4"),
        {"quantization": "sym_int4"},
        Machine((B60,), 24, image=B1),
    ),
    "0.21.0-b2 layout, one B60": Case(
        ("-q", "sym_int4"),
        {"quantization": "sym_int4"},
        Machine((B60,), 24, image=B2),
    ),
}


def doctor_says(case: Case, model: Path) -> tuple[str, object, str]:
    """doctor's path where vLLM is installed: vLLM's parser and configuration (vllmline)."""
    if "sym_int4" in case.line:
        import sym_int4_replay

        sym_int4_replay.register()  # as Intel's images register it, before vLLM reads -q
    line = ["vllm", "serve", str(model), *case.line, *PINNED]
    version = vllmline.installed()
    assert version is not None
    reading = vllmline.read(line, {}, version)
    assert reading.configuration.startswith("built by vLLM"), reading.configuration
    args = reading.args
    machine = hostfile.parse(tomllib.loads(case.machine.host_file()), "host.toml")
    out = doctor.outcome_for(described.measurement(machine, args), args)
    return out.verdict, out.fails_at, out.main_cause


def _installed_sym_int4(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay registered as Intel's images register sym_int4, and what the preflight
    reads as the installed module: the replay's functions of that image's ``layout``."""
    import importlib.util
    import inspect
    import textwrap

    import sym_int4_replay

    from vllm_xpu_memfix.startup.host import SYM_INT4

    sym_int4_replay.register()
    monkeypatch.setenv("SYM_INT4_REPLAY_LAYOUT", layout)
    spec = importlib.util.find_spec(SYM_INT4)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The functions this layout defines (the replay defines each layout's under an if).
    functions = [f for f in vars(module).values() if inspect.isfunction(f)]
    mine = [f for f in functions if f.__code__.co_filename == spec.origin]
    source = "\n".join(textwrap.dedent(inspect.getsource(f)) for f in mine)
    monkeypatch.setattr(host, "installed_sym_int4", lambda: source)


def preflight_says(
    case: Case,
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    records: Records,
) -> tuple[str, object, str]:
    tree = case.machine.sysroot(tmp_path / "tree")
    # The image's own variables (its Dockerfile's ENV lines), as doctor takes them.
    image = catalog.image_named(case.machine.image) if case.machine.image else None
    variables = {**(image.env if image else {}), **case.machine.env}
    env = {"VLLM_XPU_MEMFIX_SYSROOT": str(tree), **variables}
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    # The driver guard runs before the preflight in vLLM's process and sets its keys there.
    for key, value in driver_env.decide(config.load(env), env).env.items():
        monkeypatch.setenv(key, value)
    if case.machine.image:
        _installed_sym_int4(REPLAY_LAYOUT[case.machine.image], monkeypatch)
    engine_config(model, env, monkeypatch, **PINNED_ARGS, **case.engine_args)
    chunks = [line.split(": ", 1)[1] for line in records.lines() if "preflight json" in line]
    judged = json.loads("".join(chunks))
    return judged["verdict"], judged["fails_at"], judged["main_cause"]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """test_preflight's sparse 27B BF16 checkpoint."""
    return sparse_27b(tmp_path / "model")


@pytest.fixture
def records() -> Iterator[Records]:
    yield from capture()


@pytest.mark.parametrize("name", CORPUS)
def test_doctor_and_the_preflight_say_the_same(
    name, model, tmp_path, monkeypatch, records, clean_env
):
    case = CORPUS[name]
    if case.config:
        path = model / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **case.config}))
    said = doctor_says(case, model)
    assert preflight_says(case, model, tmp_path, monkeypatch, records) == said, name
    logging.getLogger(__name__).info("%s: %s", name, said)


def test_the_corpus_holds_every_verdict(model):
    """Not a corpus of easy cases: doctor's verdicts over it include each of fits, at
    risk, will run out of memory and will fail."""
    path = model / "config.json"
    base = json.loads(path.read_text())
    verdicts = set()
    for case in CORPUS.values():
        path.write_text(json.dumps({**base, **case.config}))
        verdicts.add(doctor_says(case, model)[0])
    assert verdicts == {"fits", "at risk", "will run out of memory", "will fail"}


@pytest.mark.parametrize(
    ("relative", "text"),
    [("proc/meminfo", "MemTotal:       134217728 kB\n"), ("proc/self/cgroup", "junk\n")],
    ids=["no MemAvailable", "a junk cgroup list"],
)
def test_an_unreadable_room_is_unjudged_by_doctor_its_round_trip_and_the_preflight(
    relative, text, model, tmp_path, monkeypatch, records, clean_env
):
    from vllm_xpu_memfix.cli.doctor import facts

    tree = Machine((B70,)).sysroot(tmp_path / "tree")
    (tree / relative).write_text(text)
    env = {"VLLM_XPU_MEMFIX_SYSROOT": str(tree)}
    args = ServeArgs(str(model))
    here = facts.measure(config.load(env), args, env)
    assert doctor.outcome_for(here, args).not_judged == ("host",)
    written = hostfile.parse(tomllib.loads(described.write_host(here)), "written.toml")
    assert "host" in doctor.outcome_for(described.measurement(written, args), args).not_judged
    engine_config(model, env, monkeypatch)
    (line,) = [line for line in records.lines() if "preflight: " in line]
    assert "host room unreadable" in line and "host need" not in line
