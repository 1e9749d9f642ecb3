"""The ``fxshard`` command line.

    fxshard explain MODULE:FACTORY (--world-size N | --mesh RxS) --policy "by_class(Block)" \\
        --input-shape 2,16 --input-dtype long [--option reshard_root=true] [--dump DIR] [--trace FILE] \\
        [--activation-checkpointing "selective(by_class(Block))"] [--memory-budget 2GiB] [--optimizer AdamW] \\
        [--device cuda]
        [--mixed-precision bf16 [--gather-dtype fp8|int8 [--gather-scaling tensor|block]]]
        [--hardware h100-ib]  # predict the step's time there; --policy "auto()" chooses by it
    fxshard passes [--option compute=inductor]      # every graph's pass list, and why
    fxshard calibrate [--hardware NAME]   # the rates fxshard predicts time with (this machine's;
                                          # under torchrun, the live group's network too, or with
                                          # one process its collectives over that one rank)

MODULE is a dotted module name or a path to a .py file; FACTORY a function in
it that returns the model. The model is built on the meta device (no memory),
unless --no-meta. Without --input-dtype, an input the model gives an
nn.Embedding as its indices is int64 (token ids), the others float32.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from fxshard.ir.errors import FxShardError, TraceError

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from fxshard.ir.wrapping import Policy

# The parser is built without torch (``fxshard --help`` answers at once, tests/test_cli_import.py);
# torch and the compiler are imported by the commands that use them.

_TERM = re.compile(r"^\s*(by_size|by_class)\(\s*([^)]*)\)\s*$")


def load_factory(spec: str) -> tuple[ModuleType, Callable[[], nn.Module]]:
    if ":" not in spec:
        raise FxShardError(f"expected MODULE:FACTORY, got {spec!r} (e.g. examples/gpt.py:build)")
    module_name, factory_name = spec.rsplit(":", 1)
    if module_name.endswith(".py") or Path(module_name).is_file():
        path = Path(module_name).resolve()
        if not path.is_file():
            raise FxShardError(f"no file {path}: MODULE is the path of a .py file (relative to this "
                               "directory) or an importable module, e.g. examples/gpt.py:build")
        sys.path.insert(0, str(path.parent))  # so the file's own imports resolve
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        if loader_spec is None or loader_spec.loader is None:
            raise FxShardError(f"cannot import {path}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[path.stem] = module  # dataclasses and pickling look modules up by name
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not (module_name + ".").startswith(e.name + "."):
                raise  # the module exists; an import inside it failed: its traceback says where
            raise FxShardError(f"no module named {e.name!r} here: install it, or give the path of "
                               "its .py file, e.g. examples/gpt.py:build") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise FxShardError(f"{module_name} has no callable {factory_name!r}: FACTORY is a function "
                           "in it that returns the model")
    needed = _required_parameters(factory)
    if needed:
        raise FxShardError(
            f"{spec} needs arguments ({', '.join(needed)}), and FACTORY is called with none: "
            f"give a function that returns the model, e.g. def build(): return {factory_name}(...)")
    return module, factory


def _required_parameters(factory: Callable[..., Any]) -> list[str]:
    """The parameters ``factory`` cannot be called without; none where it has no signature to read."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def parse_policy(text: str | None, namespace: ModuleType) -> Policy | None:
    """``by_size(N)`` and ``by_class(Name, ...)`` terms joined by ``|``; names from the
    factory's module, then torch.nn. ``auto()``, or ``auto(units=<such a policy>)``, either
    with ``extrapolate=True`` or ``False`` last."""
    if not text:
        return None
    automatic = re.match(r"^\s*auto\((?:\s*units\s*=\s*(.*?))?\s*(?:,?\s*extrapolate\s*=\s*(True|False)\s*)?\)\s*$",
                         text)
    if automatic is not None:
        from fxshard.ir.wrapping import auto

        units, extrapolate = automatic.groups()
        return auto(parse_policy(units, namespace) if units else None,
                    extrapolate=None if extrapolate is None else extrapolate == "True")
    import torch.nn as nn

    from fxshard.ir.wrapping import by_class, by_size

    policy: Policy | None = None
    for term in text.split("|"):
        match = _TERM.match(term)
        if match is None:
            raise FxShardError(f"cannot parse policy term {term.strip()!r}: use by_size(N) or by_class(Name, ...)")
        kind, body = match.groups()
        if kind == "by_size":
            part = by_size(float(body))
        else:
            classes = []
            for name in (n.strip() for n in body.split(",") if n.strip()):
                cls = getattr(namespace, name, None) or getattr(nn, name, None)
                if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                    raise FxShardError(f"by_class: no nn.Module class {name!r} in {namespace.__name__} or torch.nn")
                classes.append(cls)
            part = by_class(*classes)
        policy = part if policy is None else policy | part
    return policy


def parse_checkpointing(text: str | None, namespace: ModuleType) -> Policy | None:
    """A policy as for ``--policy``, or ``selective(<policy>)``."""
    if not text:
        return None
    from fxshard.ir.wrapping import selective

    match = re.match(r"^\s*selective\((.*)\)\s*$", text)
    if match is None:
        return parse_policy(text, namespace)
    inner = parse_policy(match.group(1), namespace)
    if inner is None:
        raise FxShardError("selective() needs a policy inside, e.g. selective(by_class(Block))")
    return selective(inner)


# --gather-dtype: MixedPrecision's gather_dtype, by torch's name (no torch is imported for --help).
GATHER_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """``2GiB``, ``800MiB``, ``1.5e9``, ``123456``: a number of bytes."""
    match = re.match(r"^\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*$", text)
    unit = match.group(2).lower() if match else None
    try:
        if match is None or unit not in _UNITS:
            raise ValueError(text)
        return int(float(match.group(1)) * _UNITS[unit])
    except ValueError:
        raise FxShardError(f"cannot read {text!r} as a size: use bytes or a unit, e.g. 2GiB, 800MiB, "
                           "1.5e9") from None


def parse_optimizer(text: str) -> Any:
    """``AdamW``, ``SGD(momentum=0.9)``: a torch.optim class, or a partial of one with
    literal keywords (what ``optimizer=`` takes)."""
    import ast
    import functools

    import torch

    try:
        tree = ast.parse(text.strip(), mode="eval").body
        call = tree if isinstance(tree, ast.Call) else None
        name = (call.func if call else tree)
        if not isinstance(name, ast.Name) or (call and call.args):
            raise ValueError(text)
        keywords = {str(k.arg): ast.literal_eval(k.value) for k in call.keywords} if call else {}
        if call and any(k.arg is None for k in call.keywords):
            raise ValueError(text)
    except (SyntaxError, ValueError):
        raise FxShardError(f"--optimizer takes a torch.optim class name, with keywords if its state "
                           f"depends on them: AdamW, SGD(momentum=0.9); got {text!r}") from None
    cls = getattr(torch.optim, name.id, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise FxShardError(f"--optimizer {text!r}: torch.optim has no optimizer {name.id!r}")
    return functools.partial(cls, **keywords) if keywords else cls


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _inputs(shapes: list[str], dtypes: list[str]) -> tuple[torch.Tensor, ...]:
    import torch

    if not shapes:
        raise FxShardError("give the model's input with --input-shape (e.g. --input-shape 8,1024)")
    if len(dtypes) > 1 and len(dtypes) != len(shapes):
        raise FxShardError(f"{len(dtypes)} --input-dtype for {len(shapes)} --input-shape: give one dtype "
                           "for every input, or one per input in the same order")
    result = []
    for i, shape in enumerate(shapes):
        try:
            dims = tuple(int(d) for d in shape.split(","))
        except ValueError:
            raise FxShardError(f"--input-shape {shape!r}: comma-separated whole numbers, e.g. "
                               "--input-shape 8,1024") from None
        name = dtypes[i] if len(dtypes) > 1 else (dtypes[0] if dtypes else "float32")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise FxShardError(f"unknown dtype {name!r}")
        result.append(torch.zeros(dims, dtype=dtype, device="meta"))
    return tuple(result)


def _token_ids_as_int64(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Without --input-dtype, the inputs the model gives an nn.Embedding as indices are
    int64 (token ids), the others float32. An input the forward changes before the
    embedding (ids + 1) is not recognised: tracing then fails with a hint to pass
    --input-dtype int64."""
    import torch

    from fxshard.explain import embedding_inputs

    ids = embedding_inputs(model, inputs)
    for i, name in ids.items():
        print(f"fxshard explain: no --input-dtype given: input {i} indexes nn.Embedding {name!r}, "
              "so it is int64", file=sys.stderr)
    return tuple(x.to(torch.int64) if i in ids else x for i, x in enumerate(inputs))


def _options(items: list[str]) -> dict[str, Any]:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise FxShardError(f"--option takes key=value, got {item!r}")
        options[key.strip()] = _value(value.strip())
    return options


def _passes(items: list[str]) -> int:
    from fxshard.ir.config import CompileConfig
    from fxshard.passes import describe

    try:
        text = describe(CompileConfig.build("explain", **_options(items)))
    except (FxShardError, TypeError, ValueError) as e:
        print(f"fxshard passes: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _mesh_shape(text: str) -> tuple[int, ...]:
    """"128x8" -> (128, 8); "8" -> (8,)."""
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not 1 <= len(shape) <= 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--mesh takes RxS (e.g. 128x8) or S, got {text!r}")
    return shape


def build_parser() -> argparse.ArgumentParser:
    """The ``fxshard`` command's parser (imports nothing heavy: torch is imported by the commands)."""
    parser = argparse.ArgumentParser(prog="fxshard", description="fxshard: FSDP as a compiler pass")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="plan, graphs and predicted memory at any world size, no cluster")
    ex.add_argument("factory", help="MODULE:FACTORY returning the model")
    size = ex.add_mutually_exclusive_group(required=True)
    size.add_argument("--world-size", type=int)
    size.add_argument("--mesh", type=_mesh_shape, default=None, metavar="RxS",
                      help="a device mesh: RxS is HSDP (R replicas of S-way shards), Nx1 NO_SHARD, "
                           "S alone FULL_SHARD; --rank is a rank of the whole mesh")
    ex.add_argument("--rank", type=int, default=0)
    ex.add_argument("--policy", default=None, help='e.g. "by_class(Block) | by_size(1e6)"')
    ex.add_argument("--input-shape", action="append", default=[], help="comma-separated; repeat per input")
    ex.add_argument("--input-dtype", action="append", default=[],
                    help="torch dtype name: once for every input, or repeated once per input (default: "
                         "int64 for an nn.Embedding's indices, else float32)")
    ex.add_argument("--option", action="append", default=[], help="scheduling option key=value")
    ex.add_argument("--eval", action="store_true", help="explain an inference step")
    ex.add_argument("--activation-checkpointing", default=None,
                    help='regions to recompute: a policy, or "selective(by_class(Block))"')
    ex.add_argument("--memory-budget", default=None,
                    help="peak bytes per rank (e.g. 2GiB): shows the schedule the planner chooses")
    ex.add_argument("--optimizer", default=None, metavar="CLASS",
                    help="count the optimizer's state and step in the peak: AdamW, SGD(momentum=0.9)")
    ex.add_argument("--no-meta", action="store_true", help="build the model on its own device")
    ex.add_argument("--device", default=None,
                    help="plan for this device's kernels on fake tensors (without CUDA here, cuda plans on meta "
                         "with CUDA's fused attention); default meta")
    ex.add_argument("--dump", default=None, help="directory for per-pass graphs, timeline, unit graph")
    ex.add_argument("--trace", default=None, metavar="FILE",
                    help="write the predicted step as a Chrome trace (JSON; Perfetto, chrome://tracing); "
                         "its time axis is node order")
    ex.add_argument("--graphs", action="store_true", help="print the emitted graphs' code")
    ex.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None,
                    help="param_dtype bf16/fp16, reduce_dtype fp32 (fxshard.MixedPrecision)")
    ex.add_argument("--gather-dtype", choices=tuple(GATHER_DTYPES), default=None,
                    help="quantized weight gathers (MixedPrecision's gather_dtype; with --mixed-precision bf16)")
    ex.add_argument("--gather-scaling", choices=("tensor", "block"), default=None,
                    help="a quantized gather's scales: per parameter (tensor, the default) or per block")
    ex.add_argument("--hardware", default=None, metavar="NAME",
                    help="predict the step's time on a named profile (fxshard calibrate --list)")
    ca = sub.add_parser("calibrate", help="the rates fxshard predicts time with: this machine's, or a profile's")
    ca.add_argument("--hardware", default=None, metavar="NAME", help="print a named profile instead")
    ca.add_argument("--list", action="store_true", help="list the named profiles")
    ps = sub.add_parser("passes", help="the pass list of every graph, and why each pass is where it is")
    ps.add_argument("--option", action="append", default=[], help="option key=value, as for explain")
    co = sub.add_parser("consolidate", help="a sharded checkpoint to one file of full weights")
    co.add_argument("checkpoint", help="a DCP checkpoint directory (fxshard.checkpoint.save)")
    co.add_argument("out", help="the file to write: the model's full state dict, original names")
    co.add_argument("--format", choices=("torch", "safetensors"), default="torch")
    co.add_argument("--optimizer", action="store_true", help="also write the optimizer state to OUT.optim")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "passes":
        return _passes(args.option)
    if args.command == "consolidate":
        return _consolidate(args)
    if args.command == "calibrate":
        return _calibrate(args)
    return _explain(args)


def _calibrate(args: argparse.Namespace) -> int:
    """This machine's device rates (measured once, cached per device, torch release and thread
    count); under torchrun also the live group's network, agreed over the ranks (with one
    process, its collectives over a group of that one rank, as ``Driver.timing`` measures
    them); or a profile."""
    import os

    import torch
    import torch.distributed as dist

    from fxshard.driver.report import calibrate
    from fxshard.ir.cost import PROFILES, hardware

    if args.list:
        for name, rates in sorted(PROFILES.items()):
            print(f"{name}: {rates.device.name}; {rates.network.name}")
        return 0
    if args.hardware:
        try:
            print(hardware(args.hardware))
        except FxShardError as e:
            print(f"fxshard calibrate: error: {e}", file=sys.stderr)
            return 2
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Under torchrun (which sets both), also with one process: its collectives over that one rank.
    if world_size > 1 or "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        from fxshard.driver.run.runtime import comm_device, resolve_world, with_comm_groups

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            world = with_comm_groups(resolve_world(None), 1, None)
            rates = calibrate.calibrate(world, comm_device(world.comm_group))
        finally:
            dist.destroy_process_group()
        if world.rank == 0:
            print(rates)
        return 0
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    print(calibrate.local_rates(device))
    print(f"(cached in {calibrate.cache_path()}; run under torchrun to measure the network too)")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from fxshard.consolidate import consolidate

    try:
        written = consolidate(args.checkpoint, args.out, format=args.format, optimizer=args.optimizer)
    except FxShardError as e:
        print(f"fxshard consolidate: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # one that consolidate has not turned into an error naming the fix
        print(f"fxshard consolidate: error: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _explain(args: argparse.Namespace) -> int:
    import torch

    from fxshard.explain import explain

    try:
        module, factory = load_factory(args.factory)
        if args.no_meta:
            model = factory()
        else:
            with torch.device("meta"):
                model = factory()
        options = _options(args.option)
        if args.activation_checkpointing:
            options["activation_checkpointing"] = parse_checkpointing(args.activation_checkpointing, module)
        if args.memory_budget:
            options["memory_budget"] = parse_bytes(args.memory_budget)
        if args.optimizer:
            options["optimizer"] = parse_optimizer(args.optimizer)
        if args.gather_scaling and not args.gather_dtype:
            raise FxShardError("--gather-scaling needs --gather-dtype (fp8, fp8_e5m2 or int8)")
        if args.mixed_precision or args.gather_dtype:
            from fxshard.ir.precision import MixedPrecision

            param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.mixed_precision]
            options["mixed_precision"] = MixedPrecision(
                param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                gather_dtype=getattr(torch, GATHER_DTYPES[args.gather_dtype]) if args.gather_dtype else None,
                gather_scaling=args.gather_scaling)
        inputs = _inputs(args.input_shape, args.input_dtype)
        if not args.input_dtype:
            inputs = _token_ids_as_int64(model, inputs)
        result = explain(model, inputs, parse_policy(args.policy, module), args.world_size,
                         mesh_shape=args.mesh, rank=args.rank, train=not args.eval, dump_dir=args.dump,
                         device=args.device, hardware=args.hardware, **options)
    except (FxShardError, TypeError, ValueError) as e:
        note = ""
        if isinstance(e, TraceError) and e.kind in ("index-dtype", "dtype") and not args.input_dtype:
            note = "\n(no --input-dtype was given, so the inputs were float32)"
        print(f"fxshard explain: error: {e}{note}", file=sys.stderr)
        return 2
    print(result)
    if args.trace:
        from fxshard.driver.report.trace_events import write_trace

        try:
            path = write_trace(args.trace, result.graphs, result.report)
        except OSError as e:
            print(f"fxshard explain: error: cannot write the trace to {args.trace}: {e}", file=sys.stderr)
            return 2
        axis = ("predicted microseconds" if result.report.predicted_step_seconds is not None
                else "node order, 1 node = 1 us (--hardware predicts microseconds)")
        print(f"\nwrote {path}: the predicted step as a Chrome trace (open in ui.perfetto.dev); its time "
              f"axis is {axis}")
    if args.graphs:
        for name, gm in result.graphs.items():
            print(f"\n--- {name} graph ---\n{gm.code}")
    if args.dump:
        print(f"\ndumped to {args.dump}: plan.txt, report.txt, passes/, trace.json, timeline.png/.svg, "
              "units.graphml/.dot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
