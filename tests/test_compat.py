"""torch's internals are reached through one module, ``fxshard/ir/compat.py``.

An AST scan of ``fxshard/`` (``fxshard/passes/`` included) finds every private torch name
outside it:

- imports of a torch module with a private part (``torch._dynamo``,
  ``torch.distributed._shard``), or of a ``_name`` from a torch module;
- attribute paths from a name bound to torch (``torch._C``,
  ``dist.distributed_c10d._get_default_timeout``, an alias ``_c10d =
  torch.ops._c10d_functional``); operator names below ``torch.ops.<namespace>``
  (``aten._scaled_dot_product_flash_attention``) are operators, not Python
  privates, and pass;
- ``x._name`` on any other object, and ``getattr(x, "_name")``, where no
  fxshard module defines ``_name`` itself (``group._get_backend``,
  ``op._schema``): without types the scan cannot tell whose object it is,
  so a private attribute fxshard did not make is taken for torch's;
- strings naming a private torch module (``import_module("torch._inductor")``).

Each hit must be on ``ALLOWED`` with its reason, or move into compat.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

# The scan and the names on the installed torch: in the release tier.
pytestmark = pytest.mark.release

ROOT = Path(__file__).resolve().parent.parent
COMPAT = Path("fxshard/ir/compat.py")

# (file, private name) -> why it stays where it is. These do not differ between the
# supported releases; the rest is in compat, whose docstring says what differs.
ALLOWED: dict[tuple[str, str], str] = {
    **{(path, name): "nn.Module's own parameter and buffer dicts, unchanged since torch 1.0: "
       "the one way to put a stand-in (meta, another dtype) where a Parameter was without "
       "Module.__setattr__'s type checks and registration hooks"
       for path, name in (("fxshard/driver/state/init.py", "_parameters"), ("fxshard/driver/state/init.py", "_buffers"),
                          ("fxshard/driver/run/runtime.py", "_parameters"), ("fxshard/ir/plan.py", "_parameters"))},
    **{("fxshard/driver/compile/plan_auto.py", name): "nn.Module's own parameter and buffer dicts, unchanged "
       "since torch 1.0: a shallow copy of a module (auto()'s model cut to a few blocks) given dicts "
       "of its own, so that the trace's functional_call swaps the copy's entries, not the original's"
       for name in ("_parameters", "_buffers")},
    ("fxshard/driver/state/init.py", "_init_weights"): "transformers' PreTrainedModel._init_weights, "
    "not torch's: meta-device init calls the model's own initialiser when it has one",
    ("fxshard/explain.py", "_base"): "Tensor._base (a view's base), unchanged since torch 1.0: "
    "an embedding's indices that are a view of a model input",
    ("fxshard/driver/state/state_dicts.py", "_init_from_local_shards_and_global_metadata"): "ShardedTensor's "
    "constructor from each rank's boxes without a collective; the class comes from compat",
    ("fxshard/driver/state/state_dicts.py", "_non_persistent_buffers_set"): "nn.Module's record of "
    "non-persistent buffers, unchanged since torch 1.6; state_dict() leaves them out",
    ("fxshard/hf.py", "_no_split_modules"): "transformers' PreTrainedModel attribute, not torch's: "
    "the decoder layer classes, which Accelerate's FSDP plugin also wraps by default",
    ("fxshard/driver/compile/inductor.py", "_guards"): "TracingContext and tracing, the same on 2.11, 2.13 "
    "and 2.15: the context in which Inductor's FX graph cache finds a shape environment, without "
    "which it bypasses every graph fxshard hands it; compat's row when fxshard/ir/compat.py next changes",
    **{("fxshard/driver/report/calibrate.py", name): "an aten operator's own name (aten's naming, not a "
       "private Python API; the same on 2.11, 2.13 and 2.15): an operator calibration times per "
       "element, whose kernel is slower than streaming its bytes"
       for name in ("_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data")},
    ("fxshard/driver/compile/inductor.py", "_dynamo"): "torch._dynamo.utils.counters, the same on 2.11, 2.13 "
    "and 2.15: the FX graph cache's hit, miss and bypass counts, which the compile logs",
    ("fxshard/lightning.py", "_layer_sync"): "Lightning's, not torch's: where Trainer(sync_batchnorm=True) "
    "leaves its LayerSync for the strategy (Lightning's DDP and FSDP strategies read it there); "
    "FxShardStrategy refuses it",
}


@dataclass(frozen=True)
class Hit:
    path: str
    line: int
    name: str  # the private part: a module path, an attribute, a string
    source: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name} ({self.source})"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _defined_by_fxshard(trees: list[ast.Module]) -> set[str]:
    """Names fxshard makes itself: functions, classes, fields, ``self.x``, locals, arguments."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return names


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None unless a name followed by attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _private_in_path(path: list[str]) -> str | None:
    """The first private part of a torch path, skipping operator names under torch.ops.<ns>."""
    for i, part in enumerate(path):
        if i >= 3 and path[1] == "ops":
            return None  # torch.ops.<namespace>.<operator>...: operator names, not Python privates
        if _private(part):
            return ".".join(path[: i + 1])
    return None


def scan(path: str, tree: ast.Module, defined: set[str]) -> list[Hit]:
    hits: list[Hit] = []
    # Names bound to torch, as the full torch path they stand for.
    torch_names: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names[a.asname or "torch"] = a.name.split(".") if a.asname else ["torch"]
                    if (p := _private_in_path(a.name.split("."))):
                        hits.append(Hit(path, node.lineno, p, "import"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            module = node.module.split(".")
            if (p := _private_in_path(module)):
                hits.append(Hit(path, node.lineno, p, "import"))
            for a in node.names:
                torch_names[a.asname or a.name] = [*module, a.name]
                if _private(a.name):
                    hits.append(Hit(path, node.lineno, a.name, f"from {node.module} import"))
    # Module-level aliases: _aten = torch.ops.aten, _c10d = torch.ops._c10d_functional
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _chain(node.value)
            if chain and chain[0] in torch_names:
                torch_names[node.targets[0].id] = [*torch_names[chain[0]], *chain[1:]]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in torch_names:
                full = [*torch_names[chain[0]], *chain[1:]]
                p = _private_in_path(full)
                # Report each path once: at its first private part.
                if p and p.split(".")[-1] == node.attr:
                    hits.append(Hit(path, node.lineno, p, ast.unparse(node)))
            elif _private(node.attr) and node.attr not in defined:
                hits.append(Hit(path, node.lineno, node.attr, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in defined):
            hits.append(Hit(path, node.lineno, node.args[1].value, ast.unparse(node)))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value.startswith("torch.") and " " not in node.value
              and (p := _private_in_path(node.value.split(".")))):
            hits.append(Hit(path, node.lineno, p, repr(node.value)))
    return hits


def sources() -> dict[str, str]:
    """fxshard's modules outside compat, by path from the repository root."""
    files = sorted((ROOT / "fxshard").rglob("*.py"))
    texts = {str(f.relative_to(ROOT)): f.read_text() for f in files if not f.is_symlink()}
    texts.pop(str(COMPAT))
    return texts


def check(texts: dict[str, str]) -> None:
    """Raise unless every private torch name in ``texts`` is allow-listed, and every entry used."""
    trees = {path: ast.parse(text) for path, text in texts.items()}
    defined = _defined_by_fxshard(list(trees.values()))
    hits = [hit for path, tree in trees.items() for hit in scan(path, tree, defined)]
    assert hits, "the scan found nothing: it is not looking (the allow-list has entries)"
    unexpected = [h for h in hits if (h.path, h.name.split(".")[-1]) not in ALLOWED]
    assert not unexpected, (
        "private torch names outside fxshard/ir/compat.py; import them from compat (and say in "
        "its table what differs between releases) or allow-list them in tests/test_compat.py "
        "with the reason:\n" + "\n".join(map(str, unexpected)))
    stale = sorted(set(ALLOWED) - {(h.path, h.name.split(".")[-1]) for h in hits})
    assert not stale, f"allow-list entries no file uses any more: {stale}"


def test_private_torch_names_only_in_compat_or_allowed() -> None:
    check(sources())


@pytest.mark.parametrize("source, expected", [
    ("import torch\nx = torch._C.DisableTorchFunctionSubclass()", ["torch._C"]),
    ("import torch._dynamo", ["torch._dynamo"]),
    ("from torch.testing._internal.distributed.fake_pg import FakeStore", ["torch.testing._internal"]),
    ("from torch.fx.graph import _BoxedCodeGen", ["_BoxedCodeGen"]),
    ("import torch.distributed as dist\ndist.distributed_c10d._get_default_timeout('gloo')",
     ["torch.distributed.distributed_c10d._get_default_timeout"]),
    ("def f(group):\n    return group._get_backend(None)", ["_get_backend"]),
    ("def f(op):\n    return getattr(op, '_schema', None)", ["_schema"]),
    ("import torch\n_c10d = torch.ops._c10d_functional\nw = _c10d.wait_tensor",
     ["torch.ops._c10d_functional"]),
    ("import importlib\nimportlib.import_module('torch._inductor.compile_fx')", ["torch._inductor"]),
    # Not private torch names: an operator name, fxshard's own attribute, a dunder.
    ("import torch\n_aten = torch.ops.aten\nop = _aten._scaled_dot_product_flash_attention", []),
    ("class A:\n    def __init__(self):\n        self._x = 1\n    def f(self, o):\n        return o._x", []),
    ("import torch\nv = torch.__version__", []),
])
def test_scan_finds_private_names(source: str, expected: list[str]) -> None:
    tree = ast.parse(textwrap.dedent(source))
    hits = scan("example.py", tree, _defined_by_fxshard([tree]))
    assert [h.name for h in hits] == expected


def test_a_new_private_import_fails_the_check() -> None:
    """explain.py importing torch's FakeStore again, or reading a process group's private
    timeout, fails the repository check."""
    texts = sources()
    check(texts)
    fake_store = dict(texts)
    fake_store["fxshard/explain.py"] += "\nfrom torch.testing._internal.distributed.fake_pg import FakeStore\n"
    with pytest.raises(AssertionError, match=r"fxshard/explain.py:\d+: torch.testing._internal"):
        check(fake_store)
    timeout = dict(texts)
    timeout["fxshard/driver/run/runtime.py"] += "\n\ndef t(group):\n    return group._get_backend(None).options._timeout\n"
    with pytest.raises(AssertionError, match=r"runtime.py:\d+: _timeout .*\n.*runtime.py:\d+: _get_backend "):
        check(timeout)


def test_compat_names_resolve_on_this_release() -> None:
    """Every name compat exports exists on the installed torch (the release differences are real)."""
    from fxshard.ir import compat

    missing = [name for name in compat.__all__ if not hasattr(compat, name)]
    assert not missing, missing
    assert compat.op_name(__import__("torch").ops.aten.mm) == "aten::mm"


def test_the_declared_torch_range_is_the_one_ci_runs() -> None:
    """pyproject's torch range starts at the oldest release .ci/run tests and ends at the newest."""
    spec = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert spec, "pyproject.toml: torch's range is not torch>=A.B,<C.D"
    low_major, low_minor, high_major, high_minor = map(int, spec.groups())
    ci = (ROOT / ".ci" / "run").read_text()
    tested = {tuple(map(int, v)) for v in re.findall(r"\btorch==(\d+)\.(\d+)\.\d+", ci)}
    versions = re.search(r"releases=\(([\d. ]+)\)", ci)
    assert versions, ".ci/run: no list of torch releases (releases=(...))"
    tested |= {tuple(map(int, v.split(".")[:2])) for v in versions.group(1).split()}
    assert (low_major, low_minor) in tested and (high_major, high_minor - 1) in tested, (
        spec.group(0), sorted(tested))


def test_names_that_differ_between_releases_are_reached_through_compat() -> None:
    """Public names that some supported release lacks (``dist.all_gather_single``: 2.11) must
    be called through compat; the private-name scan cannot see them."""
    root = Path(__file__).resolve().parent.parent
    offenders = [f"{path.relative_to(root)}:{n}" for path in sorted((root / "fxshard").rglob("*.py")) if path.name != "compat.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "dist.all_gather_single" in line]
    assert not offenders, offenders


# -- the release tier --------------------------------------------------------------------------
# .ci/run runs the release tier (``-m release``) on the oldest and newest supported torch. A test
# joins it with ``@pytest.mark.release("name", ...)``, naming the rows of compat's table (the
# names whose behaviour differs between releases) it exercises; ``@pytest.mark.release`` with no
# name joins it for another reason its docstring or comment gives (a DDP parity, a front end).


def table_names(docstring: str) -> list[str]:
    """The names in the first column of compat's table of release differences."""
    rows = docstring.split("What differs between the releases:", 1)[1].split("Why fxshard needs", 1)[0]
    rules = [i for i, line in enumerate(rows.splitlines()) if line.startswith("====")]
    assert len(rules) == 3, "compat's table: a header rule, a rule under the header, a closing rule"
    body = rows.splitlines()[rules[1] + 1: rules[2]]
    return [m.group(1) for line in body if (m := re.match(r"``(\w+)``\s", line))]


def release_marks(tests: dict[str, str]) -> dict[str, set[str]]:
    """compat name -> the tests (``file::function``) whose ``pytest.mark.release`` names it; the
    key "" collects every test in the tier. A module's ``pytestmark`` counts for its tests."""
    marks: dict[str, set[str]] = {}

    def names(call: ast.expr) -> list[str] | None:
        chain = _chain(call.func if isinstance(call, ast.Call) else call)
        if chain is None or chain[-3:] != ["pytest", "mark", "release"]:
            return None
        args = call.args if isinstance(call, ast.Call) else []
        return [a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)]

    for path, text in tests.items():
        tree = ast.parse(text)
        module_names: list[str] | None = None
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                    for t in node.targets):
                values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                for value in values:
                    if (found := names(value)) is not None:
                        module_names = found
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            found_names = [n for d in node.decorator_list if (n := names(d)) is not None]
            if module_names is not None:
                found_names.append(module_names)
            for found in found_names:
                for name in ["", *found]:
                    marks.setdefault(name, set()).add(f"{path}::{node.name}")
    return marks


def _test_sources() -> dict[str, str]:
    return {f"tests/{p.name}": p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py"))}


def test_every_name_in_compats_table_has_a_test_in_the_release_tier() -> None:
    from fxshard.ir import compat

    names = table_names(compat.__doc__ or "")
    assert {"all_gather_single", "BACKWARD_HOLDS_TANGENTS"} <= set(names), names  # the parse reads the table
    marks = release_marks(_test_sources())
    uncovered = [n for n in names if not marks.get(n)]
    assert not uncovered, (
        f"compat's table names {uncovered}, but no test in the release tier exercises them: mark "
        "one that does with @pytest.mark.release(\"<name>\")")
    unknown = sorted(n for n in marks if n and n not in names)
    assert not unknown, f"@pytest.mark.release names that are not in compat's table: {unknown}"


def test_the_release_tier_check_sees_marks_and_misses() -> None:
    """The check reads decorators and a module's pytestmark, and a table row without a test is a
    miss."""
    source = textwrap.dedent('''
        import pytest
        @pytest.mark.release("compiling")
        def test_a(): ...
        @pytest.mark.release
        def test_b(): ...
        def test_c(): ...
    ''')
    module = "import pytest\npytestmark = [pytest.mark.release('all_gather_single')]\ndef test_d(): ...\n"
    marks = release_marks({"tests/test_x.py": source, "tests/test_y.py": module})
    assert marks == {"": {"tests/test_x.py::test_a", "tests/test_x.py::test_b", "tests/test_y.py::test_d"},
                     "compiling": {"tests/test_x.py::test_a"},
                     "all_gather_single": {"tests/test_y.py::test_d"}}
    table = textwrap.dedent('''
        What differs between the releases:

        ======  ====
        name    2.11
        ======  ====
        ``a``   x
        (more)  y
        ``b``   z
        ======  ====

        Why fxshard needs each name
    ''')
    assert table_names(table) == ["a", "b"]
