"""A pasted serve line read as ``vllm serve`` reads it, by the vLLM installed here.

vLLM's own parser (``make_arg_parser`` of vllm/entrypoints/launchers/cli_args.py on a
``FlexibleArgumentParser`` subcommand, as vllm/entrypoints/cli/serve.py's
``ServeSubcommand.subparser_init`` builds it), ``AsyncEngineArgs.from_cli_args`` and
``create_engine_config`` (the OpenAI server's usage context; no device, no weights), then
``startup.engine_config.serve_args``: the path the preflight reads inside ``vllm serve``.

- A flag vLLM's parser does not know is listed (``unknown``), never dropped in silence.
- A ``ValueError`` (pydantic's ``ValidationError`` included) while building the
  configuration is vLLM refusing: its own message, one line, goes to the model as a
  refusal; where the message names the flags, each nearest change is built again and kept
  as a remedy only where vLLM accepts it.
- Anything else (no config.json reachable, offline Hub, an import error, an inspection that
  failed in vLLM's subprocess for a package missing here) is "not built": the line's values
  as given, the model's own checks, and the reason said. A refusal counts as vLLM's only
  where the vLLM here is the release judged for and resolved the platform judged for
  (:func:`reader_for`, :func:`read`'s ``platform``); vLLM that fails to import here is
  :class:`Unavailable`, and doctor's own parser reads the line.
- The test bed's vLLM resolves its CPU platform; the fields that platform sets
  (vllm/platforms/cpu.py ``check_and_update_config``: the KV cache from
  ``VLLM_CPU_KVCACHE_SPACE``, the ``mp`` executor; vllm/engine/arg_utils.py
  ``get_batch_defaults``: 128 sequences and 2048 tokens a rank) are the start-up model's
  XPU defaults again where the line does not give them, and doctor says so.

vLLM is imported only here, on first use (seconds); with its logging, this plugin's own
registration (``VLLM_PLUGINS``) and the environment kept as they were.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import io
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NoReturn

from vllm_xpu_memfix.cli.doctor import configfile, deadline, serveline
from vllm_xpu_memfix.core.log import fit
from vllm_xpu_memfix.startup import codes, domain, engine_config
from vllm_xpu_memfix.startup.sizing import ServeArgs
from vllm_xpu_memfix.vllm_code.installed import installed

OWN_PARSER = "doctor's own parser (vLLM not installed)"
XPU_DEFAULTS = "the model's XPU defaults"
MESSAGE_LIMIT = 300
# Fields the CPU platform resolves its own way: back to the model's XPU defaults (None)
# where the line leaves them to vLLM.
_CPU_RESOLVED = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory_bytes",
    "distributed_executor_backend",
)
_BATCH = re.compile(
    r"max_num_batched_tokens \((\d+)\) must be greater than or equal to max_num_seqs \((\d+)\)"
)
_QUANT = re.compile(r"model config \((\S+)\) does not match .*`quantization` argument \((\S+)\)")
_HEADS = re.compile(
    r"attention heads \((\d+)\) must be divisible by tensor parallel size \((\d+)\)"
)
# transformers' refusal to load a configuration without its code
# (dynamic_module_utils.resolve_trust_remote_code, 4.x and 5.x) and vLLM's wording of it
# (vllm/transformers_utils/config.py, 0.32.0).
_REMOTE_CODE = re.compile(r"custom code which must be executed|trust_remote_code=True")
REMOTE_CODE = "not built: doctor does not run the checkpoint's code"
# vLLM's registry when the model class's inspection failed in its subprocess (an import of
# an optional package such as torchvision): a failure here, not a refusal
# (vllm/model_executor/models/registry.py:_raise_for_unsupported, 0.32.0).
_INSPECTION = "failed to be inspected"


class Unavailable(Exception):
    """vLLM is installed here but its parser could not be imported: one line why."""


def parser_words(version: str) -> str:
    return f"vLLM {version}'s parser"


def reader_for(described: str | None, platform_here: bool = True) -> str | None:
    """The installed vLLM's version where its parser reads the line: one is installed, no
    other version is described, and it can resolve the platform judged for here
    (``platform_here``: False for an XPU host judged on a machine without an Intel GPU);
    else None (doctor's own parser and the recorded facts, vLLM never imported)."""
    local = installed()
    if local is None or (described is not None and described != local) or not platform_here:
        return None
    return local


def own_parser(described: str | None, platform: str | None = None) -> str:
    """How doctor names its own parser where it used it."""
    local = installed()
    if local is None:
        return OWN_PARSER
    if described in (None, local) and platform is not None:
        return (
            f"doctor's own parser (the line is judged for vLLM {local} on {platform}; the "
            f"vLLM here cannot resolve {platform}: not imported)"
        )
    return f"doctor's own parser (the line is judged for vLLM {described}; {local} is installed)"


@dataclass(frozen=True)
class Fix:
    """A change of the refused line that vLLM accepts, with what vLLM then resolves."""

    code: str
    what: str
    cost: str
    args: ServeArgs


@dataclass(frozen=True)
class Reading:
    """The serve line as the model reads it, and how it was read."""

    args: ServeArgs
    parser: str
    unknown: tuple[str, ...] = ()
    configuration: str = ""  # built by vLLM, refused, or why it was not built
    defaults: str = ""  # whose platform-dependent defaults the model takes
    fixes: tuple[Fix, ...] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "parser": self.parser,
            "unknown": list(self.unknown),
            "configuration": self.configuration,
            "defaults": self.defaults,
        }


class _Reader(argparse.ArgumentParser):
    """Errors and ``--help`` raise instead of printing and exiting the process."""

    def error(self, message: str) -> NoReturn:
        raise serveline.ServeLineError(f"vLLM's parser: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise serveline.ServeLineError("the serve line asks vLLM's parser to print and exit")

    def _pull_args_from_config(self, args: list[str]) -> list[str]:
        configfile.check_count(args)
        pulled: list[str] = super()._pull_args_from_config(args)  # type: ignore[misc]
        return pulled

    def load_config_file(self, file_path: str) -> list[str]:
        return configfile.load(file_path, super().load_config_file)  # type: ignore[misc]


def _say_while_importing(version: str) -> None:
    """One line on a terminal's stderr before an import of seconds; none to a pipe or file."""
    if "vllm.engine.arg_utils" not in sys.modules and sys.stderr.isatty():
        said = f"doctor: reading the line with vLLM {version}'s parser (importing vLLM)..."
        print(said, file=sys.stderr, flush=True)


@functools.cache
def _parser(serve: bool) -> tuple[Any, Any]:
    """vLLM's serve parser: ``vllm serve``'s subcommand, or the API server module's own;
    (the parser to call, the one holding the serve arguments)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    reader = type("Reader", (_Reader, FlexibleArgumentParser), {})
    top = reader(prog="vllm")
    if not serve:
        return make_arg_parser(top), top
    subcommands = top.add_subparsers(dest="subparser", parser_class=reader)
    inner = subcommands.add_parser("serve", usage="vllm serve [model_tag] [options]")
    return top, make_arg_parser(inner)


def _plugins_but_this() -> str:
    """``VLLM_PLUGINS``: every plugin vLLM would load here but this one (whose preflight
    would judge doctor's own configuration), within a list the user set."""
    names = {
        ep.name
        for group in ("vllm.general_plugins", "vllm.platform_plugins")
        for ep in importlib.metadata.entry_points(group=group)
        if not ep.value.startswith("vllm_xpu_memfix")
    }
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None:
        names &= set(allowed.split(","))
    return ",".join(sorted(names))


@contextlib.contextmanager
def _vllm_quiet() -> Iterator[None]:
    """vLLM's logs and prints kept off doctor's output; the environment (which vLLM's CPU
    platform writes to) as it was afterwards."""
    saved = dict(os.environ)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    os.environ["VLLM_PLUGINS"] = _plugins_but_this()
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        logging.disable(disabled)
        os.environ.clear()
        os.environ.update(saved)


def _grouped(extra: Sequence[str]) -> tuple[str, ...]:
    """argparse's left-over words, a flag with the words after it."""
    items: list[str] = []
    for word in extra:
        if word.startswith("-") or not items or not items[-1].startswith("-"):
            items.append(word)
        else:
            items[-1] += f" {word}"
    return tuple(items)


def _parse(words: Sequence[str]) -> tuple[argparse.Namespace, tuple[str, ...]]:
    serve, rest = serveline.launcher_args(list(words))
    parser, _ = _parser(serve)
    known: dict[str, list[str]] = {}

    original = parser.parse_known_args

    def keep_extra(args: Any = None, namespace: Any = None) -> Any:
        namespace, extra = original(args, namespace)
        known["extra"] = list(extra)
        return namespace, []

    parser.parse_known_args = keep_extra
    try:
        namespace = parser.parse_args(["serve", *rest] if serve else rest)
    except serveline.ServeLineError:
        raise
    except (ValueError, AssertionError) as exc:  # its --config checks
        raise serveline.ServeLineError(f"vLLM's parser: {_message(exc)}") from None
    finally:
        del parser.parse_known_args
    if getattr(namespace, "model_tag", None):
        namespace.model = namespace.model_tag
    return namespace, _grouped(known.get("extra", []))


def _merge(
    namespace: argparse.Namespace, words: Sequence[str], own: Mapping[str, Any], parser: Any
) -> None:
    """doctor's own flags into the line's namespace; a value given in both must agree."""
    named = getattr(namespace, "model_tag", None) or any(
        w == "--model" or w.startswith("--model=") for w in words
    )
    model = own.get("model")
    if model and named and namespace.model != model:
        raise serveline.ServeLineError(
            f"two models: {model!r} and {namespace.model!r} in the serve line; give one"
        )
    if not (model or named):
        raise serveline.ServeLineError(serveline.NO_MODEL)
    for name, value in own.items():
        line = getattr(namespace, name, None)
        if value is None or name == "model":
            continue
        if line is not None and line != parser.get_default(name) and line != value:
            raise serveline.ServeLineError(
                f"{name} is {value!r} in doctor's flags but {line!r} in the serve line; "
                "give it in one place"
            )
        setattr(namespace, name, value)
    if model:
        namespace.model = model


def _message(exc: BaseException) -> str:
    """vLLM's message, one line: pydantic's first error without its input dump."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            first = errors()[0]
            text = str(first.get("msg", "")).removeprefix("Value error, ")
            title = getattr(exc, "title", "")
            return fit(f"{text} ({title})" if title else text, MESSAGE_LIMIT)
    return fit(" ".join(str(exc).split()), MESSAGE_LIMIT)


def _refused(exc: BaseException) -> bool:
    """vLLM refusing the line (a ValueError of its checks), not a configuration it could
    not reach: no file, no Hub, an import (huggingface_hub's offline errors are OSErrors;
    its repo-id check, reached offline for a path not on this machine, is a ValueError of
    huggingface_hub's own)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (OSError, ImportError)) or _INSPECTION in str(seen):
            return False
        if type(seen).__module__.startswith("huggingface_hub"):
            return False
        seen = seen.__cause__ or seen.__context__
    return isinstance(exc, ValueError)


def _needs_code(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if _REMOTE_CODE.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _given(namespace: argparse.Namespace, parser: Any, flags: Sequence[str]) -> ServeArgs:
    """The model's arguments as the line gives them, where vLLM built no configuration:
    ``-q`` checked against the release's methods as doctor's own parser checks it, and the
    not-modelled flags the line sets (``flags``, else read from the namespace where vLLM's
    engine arguments were not built); a value out of doctor's bounds (which vLLM refused)
    is left to the model's default."""
    names = {spec.name for spec in fields(ServeArgs)} & set(domain.DOMAIN)
    names -= set(serveline.out_of_bounds(namespace))
    values = {n: getattr(namespace, n) for n in names if getattr(namespace, n, None) is not None}
    if values.get("max_model_len") == serveline.FITTED:
        values.update(max_model_len=None, max_model_len_fitted=True)
    if "quantization" in values:
        try:
            serveline.value_of("quantization", str(values["quantization"]))
        except ValueError as exc:
            raise serveline.ServeLineError(f"-q/--quantization {exc}") from None
    if not flags:
        flags = domain.flags_set(
            {
                name: value
                for name, value in vars(namespace).items()
                if value is not None and value != parser.get_default(name)
            }
        )
    return ServeArgs(**values, not_modelled=tuple(flags))


def _not_modelled(namespace: argparse.Namespace, engine_args: Any) -> tuple[str, ...]:
    found = domain.not_modelled(engine_args)
    count = getattr(namespace, "api_server_count", None)
    if count not in (None, 1):
        found += (f"--api-server-count {count}",)
    return found


def _build(namespace: argparse.Namespace, flags: list[str]) -> Any:
    """vLLM's configuration of the line; ``flags`` gets the flags set that the model does
    not cover, as soon as vLLM's engine arguments are built."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    engine_args = AsyncEngineArgs.from_cli_args(namespace)
    # Whatever the line says: doctor reads files, it never runs a checkpoint's Python.
    engine_args.trust_remote_code = False
    flags += _not_modelled(namespace, engine_args)
    return engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)


def _resolved(config: Any, flags: tuple[str, ...], namespace: argparse.Namespace) -> ServeArgs:
    args = engine_config.serve_args(config, flags)
    if str(config.device_config.device_type) == "xpu":
        return args
    left: dict[str, Any] = {n: None for n in _CPU_RESOLVED if getattr(namespace, n, None) is None}
    return replace(args, **left)


def _defaults(platform: str, namespace: argparse.Namespace) -> str:
    if platform == "xpu":
        return "vLLM's XPU platform's (resolved here)"
    left = [domain.flag_of(n) for n in _CPU_RESOLVED if getattr(namespace, n, None) is None]
    if not left:
        return f"none taken: the line gives what vLLM's {platform} platform would set"
    return (
        f"vLLM resolved its {platform} platform here; the model's XPU defaults replace what "
        f"that platform sets for {', '.join(left)}"
    )


def _tries(message: str) -> list[tuple[str, dict[str, Any], str, str]]:
    """The nearest changes of the flags vLLM's message names: (code, change, what, cost)."""
    found: list[tuple[str, dict[str, Any], str, str]] = []
    if match := _BATCH.search(message):
        tokens, seqs = int(match.group(1)), int(match.group(2))
        found += [
            (codes.VLLM_ACCEPTS, {"max_num_batched_tokens": seqs},
             f"--max-num-batched-tokens {seqs}", "a larger batch: more activation memory"),
            (codes.VLLM_ACCEPTS, {"max_num_seqs": tokens},
             f"--max-num-seqs {tokens}", "fewer sequences at once"),
        ]  # fmt: skip
    if match := _QUANT.search(message):
        own, given = match.groups()
        found.append(
            (codes.VLLM_ACCEPTS, {"quantization": None}, f"drop -q {given}: vLLM takes {own} "
             "from the checkpoint's quantization_config", "none: the checkpoint is " + own)
        )  # fmt: skip
    if match := _HEADS.search(message):
        heads, tp = int(match.group(1)), int(match.group(2))
        below = [n for n in range(tp - 1, 0, -1) if heads % n == 0][:1]
        above = [n for n in range(tp + 1, 2 * tp + 1) if heads % n == 0][:1]
        found += [
            (codes.TP_FOR_GPUS, {"tensor_parallel_size": n},
             f"--tensor-parallel-size {n}: it divides the {heads} attention heads",
             "fewer GPUs, each with a larger share" if n < tp else f"{n - tp} more GPU(s)")
            for n in (*below, *above)
        ]  # fmt: skip
    return found


def _fixes(namespace: argparse.Namespace, message: str) -> tuple[Fix, ...]:
    """Each nearest change that vLLM's configuration accepts, built again to know."""
    found = []
    for code, change, what, cost in _tries(message):
        changed = argparse.Namespace(**{**vars(namespace), **change})
        flags: list[str] = []
        try:
            config = deadline.step("vLLM's configuration", _build, changed, flags)
        except Exception:
            continue
        found.append(Fix(code, what, cost, _resolved(config, tuple(flags), changed)))
    return tuple(found)


def _resolves(platform: str | None) -> str | None:
    """Why the vLLM here does not answer for ``platform``; None where it does."""
    if platform is None:
        return None
    from vllm.platforms import current_platform

    here = str(current_platform.device_type)
    return None if here == platform else f"vLLM here resolved its {here} platform, not {platform}"


def read(
    words: Sequence[str],
    own: Mapping[str, Any],
    version: str,
    platform: str | None = None,
) -> Reading:
    """The serve line ``words`` with doctor's ``own`` flags (EngineArgs names), read by
    the installed vLLM ``version`` for ``platform`` (None: whichever it resolves here);
    ServeLineError where its parser refuses the line, Unavailable where vLLM does not
    import."""
    serve, _ = serveline.launcher_args(list(words))
    parser = parser_words(version)
    _say_while_importing(version)
    with _vllm_quiet():
        try:
            deadline.step(f"vLLM {version}'s import", _parser, serve)
        except TimeoutError as exc:
            raise Unavailable(str(exc)) from None
        except Exception as exc:
            raise Unavailable(f"vLLM {version} here failed to import ({_message(exc)})") from exc
        namespace, unknown = _parse(words)
        _merge(namespace, words, own, _parser(serve)[1])
        flags: list[str] = []
        try:
            config = deadline.step("vLLM's configuration", _build, namespace, flags)
        except Exception as exc:
            message = _message(exc)
            given = _given(namespace, _parser(serve)[1], flags)
            if _needs_code(exc):
                return Reading(given, parser, unknown, REMOTE_CODE, XPU_DEFAULTS)
            elsewhere = _resolves(platform)
            if elsewhere is not None or not _refused(exc):
                for why in serveline.out_of_bounds(namespace).values():
                    raise serveline.ServeLineError(why) from None
                not_built = f"not built by vLLM ({elsewhere or message}); the model's own checks"
                return Reading(given, parser, unknown, not_built, XPU_DEFAULTS)
            refused = replace(given, refused=(message,))
            said = f"refused by vLLM {version}: {message}"
            fixes = _fixes(namespace, message)
            return Reading(refused, parser, unknown, said, XPU_DEFAULTS, fixes)
        args = _resolved(config, tuple(flags), namespace)
        defaults = _defaults(str(config.device_config.device_type), namespace)
    built = f"built by vLLM {version} (create_engine_config; no device, no weights)"
    return Reading(args, parser, unknown, built, defaults)
