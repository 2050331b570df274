"""Which layout of Intel's ``sym_int4`` is installed, told from its structure.

Never from a version string: the module carries none, and Intel's images of one vLLM
version have shipped different modules. A layout is recognised from the names the
module defines, their leading parameters, and the names its per-layer function refers
to (its call structure). The facts below were read from llm-scaler's
``vllm/patches/vllm_for_multi_arc.patch``; docs/research/sym-int4-layouts.md has them in
full. Imports nothing heavy: ``check`` and ``doctor`` use it on source text.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType

# name -> (leading parameters, names the function's body refers to)
Shape = Mapping[str, tuple[tuple[str, ...], frozenset[str]]]

LIBRARY_PARAMS = ("weight", "out_qweight", "out_scale", "out_features", "in_features")
LAYER_FUNCTION = "_quantize_linear_int4_inplace"
MOE_SIDE_FUNCTION = "_quantize_moe_int4_side_inplace"
MOE_SIDE_PARAMS = ("layer", "which")


@dataclass(frozen=True)
class Layout:
    key: str
    title: str
    functions: Mapping[str, tuple[str, ...]]
    layer_calls: tuple[str, ...]
    absent: tuple[str, ...] = ()
    # Names the per-layer function must not refer to.
    layer_avoids: tuple[str, ...] = ()
    device_quant: str = ""
    # What the MoE side function must look like for device_quant to take it over too.
    moe_side_calls: tuple[str, ...] = ()
    moe_side_avoids: tuple[str, ...] = ()

    def mismatch(self, shape: Shape) -> str | None:
        """Why ``shape`` is not this layout; None when it is."""
        for name, params in self.functions.items():
            if name not in shape:
                return f"no {name}"
            found = shape[name][0]
            if found[: len(params)] != params:
                return f"{name}({', '.join(found)}) instead of ({', '.join(params)})"
        calls = shape[LAYER_FUNCTION][1]
        missing = [name for name in self.layer_calls if name not in calls]
        if missing:
            return f"{LAYER_FUNCTION} does not use {', '.join(missing)}"
        used = [name for name in self.layer_avoids if name in calls]
        if used:
            return f"{LAYER_FUNCTION} uses {', '.join(used)}"
        present = [name for name in self.absent if name in shape]
        return f"it defines {', '.join(present)}" if present else None

    def moe_side_mismatch(self, shape: Shape) -> str | None:
        """Why this module's MoE side function is not the one device_quant replaces."""
        if not self.moe_side_calls:
            return f"device_quant does not take over MoE layers in the {self.key} layout"
        if MOE_SIDE_FUNCTION not in shape:
            return f"no {MOE_SIDE_FUNCTION}"
        params, calls = shape[MOE_SIDE_FUNCTION]
        if params[:2] != MOE_SIDE_PARAMS:
            return f"{MOE_SIDE_FUNCTION}({', '.join(params)}) instead of (layer, which)"
        missing = [name for name in self.moe_side_calls if name not in calls]
        if missing:
            return f"{MOE_SIDE_FUNCTION} does not use {', '.join(missing)}"
        used = [name for name in self.moe_side_avoids if name in calls]
        return f"{MOE_SIDE_FUNCTION} uses {', '.join(used)}" if used else None


SEAM = Layout(
    key="seam",
    title="0.14-based (b8.x): host round trip with a device seam for Intel's ESIMD kernel",
    functions={
        "_use_xpu_quant": (),
        "_xpu_q4_0_quantize": ("bf16_xpu",),
        LAYER_FUNCTION: ("layer",),
        "ggml_quantize_tensor": LIBRARY_PARAMS,
    },
    layer_calls=("_use_xpu_quant", "_xpu_q4_0_quantize", "ggml_quantize_tensor"),
    device_quant="fills the seam with the Triton kernel where Intel's ESIMD kernel is absent",
)
HOST_ROUND_TRIP = Layout(
    key="host-round-trip",
    title="0.21 (b2): every layer through host fp32 and the C library; K padded to the group",
    functions={
        LAYER_FUNCTION: ("layer",),
        "_register_linear_int4_layouts": ("layer", "qweight", "scale"),
        "ggml_quantize_tensor": LIBRARY_PARAMS,
    },
    layer_calls=("_register_linear_int4_layouts", "ggml_quantize_tensor"),
    absent=("_use_xpu_quant", "_xpu_q4_0_quantize"),
    device_quant="quantizes each Linear layer and MoE side on the device and hands the result "
    "to the module's layout (_register_linear_int4_layouts; <side>_qweight as uint8, "
    "<side>_qscales); the host path stays unused",
    # The 0.21 side zero-pads the intermediate size and stores the words as a uint8 view.
    moe_side_calls=("ggml_quantize_tensor", "pad", "uint8"),
)
# llm-scaler tag vllm-0.21.0-b1, whose patch is byte-identical to the one on branch
# codex/vllm-0.26-dev-image (docs/research/sym-int4-layouts.md, section 1.3).
INLINE_REGISTRATION = Layout(
    key="inline-registration",
    title="0.21 (b1): every layer through host fp32 and the C library; K padded to the "
    "group; layouts registered inline",
    functions={
        LAYER_FUNCTION: ("layer",),
        "ggml_quantize_tensor": LIBRARY_PARAMS,
    },
    # The layer function itself registers the ESIMD views and the oneDNN tensors.
    layer_calls=(
        "ggml_quantize_tensor",
        "_int4_in_features_padded",
        "weight_esimd",
        "scale_esimd",
        "qweight",
        "scales",
        "qzeros",
        "transpose_onednn_woq_format",
    ),
    absent=("_register_linear_int4_layouts", "_use_xpu_quant", "_xpu_q4_0_quantize"),
    # b2 gated the ESIMD views on this; a module that gates them would keep other tensors.
    layer_avoids=("disable_esimd_int4",),
    device_quant="quantizes each Linear layer and MoE side on the device and registers the "
    "result as the module does inline (weight_esimd, scale_esimd; qweight and scales as "
    "copies of the transposes; <side>_qweight as int32, <side>_qscales); the host path "
    "stays unused",
    # The b1 side zero-pads the intermediate size and stores the int32 words as they are.
    moe_side_calls=("ggml_quantize_tensor", "pad"),
    moe_side_avoids=("uint8",),
)
LAYOUTS = (SEAM, HOST_ROUND_TRIP, INLINE_REGISTRATION)


@dataclass(frozen=True)
class Recognised:
    layout: Layout | None
    why: str
    shape: Shape = field(default_factory=dict)

    @property
    def summary(self) -> str:
        if self.layout is None:
            return f"unknown ({self.why}): device_quant keeps the host path"
        return f"{self.layout.title}; device_quant {self.layout.device_quant}"


def recognise(shape: Shape) -> Recognised:
    if LAYER_FUNCTION not in shape:
        return Recognised(None, f"no {LAYER_FUNCTION}", shape)
    reasons = []
    for layout in LAYOUTS:
        why = layout.mismatch(shape)
        if why is None:
            return Recognised(layout, layout.key, shape)
        reasons.append(f"not {layout.key}: {why}")
    return Recognised(None, "; ".join(reasons), shape)


def shape_of_module(module: ModuleType) -> Shape:
    """The shape of an imported module: its functions' parameters and referenced names."""
    shape = {}
    for name, value in vars(module).items():
        function = inspect.unwrap(value) if callable(value) else None
        code = getattr(function, "__code__", None)
        if code is None:
            continue
        params = tuple(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
        shape[name] = (params, frozenset(code.co_names))
    return shape


def shape_of_source(source: str) -> Shape:
    """The same from source text (functions bound at module level or in its if/try)."""
    shape: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                params = tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                shape.setdefault(node.name, (params, frozenset(names)))
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for branch in (node.body, node.orelse, node.finalbody):
                    visit(branch)

    visit(ast.parse(source).body)
    return shape
