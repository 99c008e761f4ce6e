"""The import rules of ARCHITECTURE.md, checked two ways.

Statically: every .py file of a room is parsed with `ast`, and each import (module level or
lazy, including `importlib.import_module("x")` / `__import__("x")` with a literal name) is
checked against the room's forbidden names: other rooms (`pdcluster.<room>`) and third-party
top-level packages. At run time: a fresh interpreter imports the torch-free rooms and reports
whether torch, ray or the engine got loaded along the way.

Rooms are imported only through the `pdcluster` namespace (`pdcluster/<room>/`), and so are the
module-path strings that code resolves at run time (registries, `-m` targets): a bare
`"engine.models.llama"` resolves nowhere.

`router/` has three sub-rooms with rules of their own: `api` (the HTTP edge and the OpenAI
protocol), `routing` (the decision, the node and metadata links; no HTTP framework) and `sim`
(offline replay and trace generators, which the serving path never imports).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "pdcluster"

ROOMS = frozenset({
    "core", "engine", "transfer", "metadata_service", "node", "prefill_node", "decode_node",
    "router", "cluster", "proto", "benchmarks", "vllm_backend",
})
# A service's published client library, importable where its room is not (docs/architecture.md):
# the clients and the errors they raise. These modules import only core, proto, grpc and each
# other (plus the codec and wire helpers), never the server.
CLIENT_MODULES = ("pdcluster.metadata_service.client", "pdcluster.metadata_service.publisher",
                  "pdcluster.metadata_service.errors", "pdcluster.metadata_service.pod_token")
HEAVY = frozenset({"torch", "ray", "vllm"})
RUNTIME_FORBIDDEN = frozenset({"torch", "ray", "engine"})  # engine: pdcluster.engine


def room_of(module: str) -> str | None:
    """The room a dotted module name belongs to (`pdcluster.core.x` -> `core`), else None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pdcluster" and len(parts) > 1 else None


def _forbidden_name(module: str) -> str:
    """What a rule names: the room of a project module, the top-level name of any other."""
    return room_of(module) or module.split(".")[0]


def _all_rooms_but(*allowed: str) -> frozenset[str]:
    return ROOMS - set(allowed)


# room -> rooms and top-level packages it must never import (the arrows in ARCHITECTURE.md).
# A room importing itself is always fine. `cluster` and `benchmarks` are launchers:
# `benchmarks` is not restricted here, `cluster` only kept from importing `benchmarks`.
FORBIDDEN: dict[str, frozenset[str]] = {
    "core": HEAVY | _all_rooms_but("core"),
    # The engine knows nothing of the node wire protocol or its sockets (node/ serves it).
    "engine": {"ray", "zmq", "vllm"} | _all_rooms_but("engine", "core"),
    "transfer": {"ray", "vllm"} | _all_rooms_but("transfer", "core"),
    "router": HEAVY | _all_rooms_but("router", "core", "proto"),
    "metadata_service": HEAVY | _all_rooms_but("metadata_service", "core", "proto"),
    # The node runtime shared by both node kinds (docs/architecture.md): no Ray in it, and
    # vLLM only through the vLLM backend (which it loads when a node's engine is vLLM).
    "node": {"ray", "vllm"} | _all_rooms_but("node", "engine", "transfer", "core", "proto",
                                              "vllm_backend"),
    # vLLM behind the node's engine interface: the only room that imports vllm.
    "vllm_backend": {"ray"} | _all_rooms_but("vllm_backend", "engine", "transfer", "core"),
    "prefill_node": _all_rooms_but("prefill_node", "node", "engine", "transfer", "core",
                                   "proto"),
    "decode_node": _all_rooms_but("decode_node", "node", "engine", "transfer", "core", "proto"),
    # The launcher imports no benchmark: features it offers (replay) live in product rooms;
    # only the `bench` subcommands load a benchmark, by name, when run.
    "cluster": frozenset({"benchmarks"}),
}


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module name) for every absolute import in the tree."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in {"__import__", "import_module"}
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def find_violations(source: str, filename: str, forbidden: frozenset[str]) -> list[str]:
    """'file:line imports name' for each import of a forbidden room or package."""
    tree = ast.parse(source, filename=filename)
    return [
        f"{filename}:{line} imports {name}"
        for line, name in _imported_names(tree)
        if _forbidden_name(name) in forbidden and not _is_client_module(name)
    ]


def _is_client_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in CLIENT_MODULES)


def _room_files(room: str) -> list[Path]:
    return sorted(p for p in (PACKAGE / room).rglob("*.py")
                  if "__pycache__" not in p.parts and not p.name.endswith("_pb2.py"))


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_follow_the_architecture(room: str) -> None:
    violations = []
    for path in _room_files(room):
        rel = str(path.relative_to(REPO_ROOT))
        violations += find_violations(path.read_text(encoding="utf-8"), rel, FORBIDDEN[room])
    assert not violations, "forbidden imports:\n" + "\n".join(violations)


HARNESSES = REPO_ROOT / "benchmarks"  # the checkout's harnesses: `benchmarks.<module>`


def _is_harness(name: str) -> bool:
    """A module of the checkout's top-level benchmarks/ (not the pdcluster.benchmarks room)."""
    parts = name.split(".")
    return parts[0] == "benchmarks" and (
        len(parts) == 1 or (HARNESSES / f"{parts[1]}.py").is_file())


def bare_room_imports(source: str, filename: str) -> list[str]:
    """'file:line imports name' for each import of a room outside the pdcluster namespace."""
    return [f"{filename}:{line} imports {name}"
            for line, name in _imported_names(ast.parse(source, filename=filename))
            if name.split(".")[0] in ROOMS and not _is_harness(name)]


def checkout_imports(source: str, filename: str) -> list[str]:
    """'file:line imports name' for each import of what only a checkout has: the harnesses of
    benchmarks/ and the tests (neither is installed)."""
    return [f"{filename}:{line} imports {name}"
            for line, name in _imported_names(ast.parse(source, filename=filename))
            if name.split(".")[0] in {"benchmarks", "tests"}]


def test_the_package_imports_no_harness_and_no_test() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += checkout_imports(path.read_text(encoding="utf-8"),
                                  str(path.relative_to(REPO_ROOT)))
    assert not found, "the installed package cannot import these:\n" + "\n".join(found)
    assert checkout_imports("from benchmarks.chaos_bench import run\nimport tests.x\n"
                            "import pdcluster.benchmarks.engine_bench\n", "x.py") == [
        "x.py:1 imports benchmarks.chaos_bench", "x.py:2 imports tests.x"]


def test_rooms_are_imported_through_the_namespace() -> None:
    files = [p for room in sorted(ROOMS) for p in _room_files(room)]
    files += sorted((REPO_ROOT / "tests").rglob("*.py"))
    files += sorted((REPO_ROOT / "scripts").rglob("*.py"))
    files += sorted(HARNESSES.rglob("*.py"))
    found = []
    for path in files:
        rel = str(path.relative_to(REPO_ROOT))
        found += bare_room_imports(path.read_text(encoding="utf-8"), rel)
    assert not found, "import these as pdcluster.<room>:\n" + "\n".join(found)


def test_bare_room_check_catches_an_offender() -> None:
    source = ("import core.types\nfrom engine import LLM\nimport pdcluster.core\nimport corey\n"
              "from benchmarks import chaos_bench\nimport benchmarks.engine_bench\n")
    assert bare_room_imports(source, "x.py") == ["x.py:1 imports core.types",
                                                 "x.py:2 imports engine",
                                                 "x.py:6 imports benchmarks.engine_bench"]


OFFENDING_SOURCE = textwrap.dedent("""
    import os
    import torch.nn as nn
    from pdcluster.engine.model import Model
    from . import sibling
    from .engine import local_thing

    def lazy():
        import ray
        import importlib
        return importlib.import_module("pdcluster.engine.sample.sampler"), __import__("torch")
""")


def test_checker_flags_synthetic_offender() -> None:
    violations = find_violations(OFFENDING_SOURCE, "fake.py", FORBIDDEN["router"])
    assert violations == [
        "fake.py:3 imports torch.nn",
        "fake.py:4 imports pdcluster.engine.model",
        "fake.py:9 imports ray",
        "fake.py:11 imports pdcluster.engine.sample.sampler",
        "fake.py:11 imports torch",
    ]


def test_checker_ignores_lookalikes_and_relative_imports() -> None:
    source = ("import torchvision\nimport pdcluster.core.types\nfrom .engine import x\n"
              "import rayon\nimport engine_tools\n")
    assert find_violations(source, "ok.py", FORBIDDEN["core"]) == []


def test_core_may_not_import_other_rooms() -> None:
    assert find_violations("from pdcluster.transfer import x\n", "c.py", FORBIDDEN["core"])
    assert find_violations("import pdcluster.proto.foo_pb2\n", "c.py", FORBIDDEN["core"])


def test_engine_may_not_import_ray_or_services() -> None:
    for name in ("ray", "router", "metadata_service", "transfer", "prefill_node",
                 "decode_node", "cluster"):
        module = name if name == "ray" else f"pdcluster.{name}"
        assert find_violations(f"import {module}\n", "e.py", FORBIDDEN["engine"]), name
    assert find_violations("import torch\nimport pdcluster.core\n", "e.py",
                           FORBIDDEN["engine"]) == []


def test_engine_may_not_import_zmq() -> None:
    assert find_violations("import zmq.asyncio\n", "e.py", FORBIDDEN["engine"])


def _room_modules(room: str) -> list[str]:
    """The room's package plus every module in it, except `__main__` entry points."""
    return [name for name in _module_files(room) if not name.endswith(".__main__")]


def loaded_forbidden_modules(modules: list[str], cwd: Path = REPO_ROOT) -> list[str]:
    """Import `modules` in a fresh interpreter; return the torch/ray/engine modules it loaded."""
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "def name(m):\n"
        "    parts = m.split('.')\n"
        "    return parts[1] if parts[0] == 'pdcluster' and len(parts) > 1 else parts[0]\n"
        f"print(sorted(m for m in sys.modules if name(m) in {set(RUNTIME_FORBIDDEN)!r}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"importing {modules} failed:\n{proc.stderr}"
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("room", ["core", "router", "metadata_service"])
def test_torch_free_room_imports_no_torch(room: str) -> None:
    assert loaded_forbidden_modules(_room_modules(room)) == []


def test_cli_module_imports_no_torch() -> None:
    assert loaded_forbidden_modules(["pdcluster.cluster", "pdcluster.cluster.cli"]) == []


def test_runtime_check_catches_an_offender(tmp_path: Path) -> None:
    (tmp_path / "pdcluster" / "engine").mkdir(parents=True)
    (tmp_path / "pdcluster" / "__init__.py").write_text("")
    (tmp_path / "pdcluster" / "engine" / "__init__.py").write_text("")
    (tmp_path / "offender.py").write_text("import pdcluster.engine\n")
    assert loaded_forbidden_modules(["offender"], cwd=tmp_path) == ["pdcluster.engine"]


def test_only_the_metadata_client_library_crosses_rooms() -> None:
    allowed = "from pdcluster.metadata_service.client import MetadataClient\n" \
              "import pdcluster.metadata_service.publisher\n"
    assert find_violations(allowed, "r.py", FORBIDDEN["router"]) == []
    assert find_violations("from pdcluster.metadata_service.index import BlockIndex\n", "r.py",
                           FORBIDDEN["router"])
    assert find_violations("import pdcluster.metadata_service\n", "n.py", FORBIDDEN["node"])


def test_the_metadata_client_library_does_not_load_the_service() -> None:
    """What other rooms import must stay a client: no server, service logic, index or store."""
    code = ("import sys, pdcluster.metadata_service.client, pdcluster.metadata_service.publisher\n"
            "print(sorted(m for m in sys.modules if m.split('.')[-1] in "
            "{'server', 'service', 'index', 'store', 'etcd_store', 'etcd_watch'} "
            "and m.startswith('pdcluster.metadata_service')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "[]", proc.stdout


# ---- no import cycles ------------------------------------------------------------------------

def _module_files(*rooms: str) -> dict[str, Path]:
    """Installed dotted module name (`pdcluster.core.x`) -> file, for every module of the rooms
    (all of them when none is named)."""
    modules: dict[str, Path] = {}
    for room in sorted(rooms or ROOMS):
        for path in _room_files(room):
            parts = path.relative_to(PACKAGE).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(("pdcluster", *parts))] = path
    return modules


def _imported_modules(tree: ast.AST, module: str, is_package: bool,
                      known: set[str]) -> set[str]:
    """The project modules `module` imports anywhere in its source, lazy imports included:
    `from a.b import c` names `a.b.c` when that is a module, else `a.b`."""
    package = module if is_package else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.append(full if full in known else base)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.append(arg.value)
    return {name for name in names if name in known and name != module}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    known = set(modules)
    return {name: _imported_modules(ast.parse(path.read_text(encoding="utf-8")), name,
                                    path.name == "__init__.py", known)
            for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_anywhere() -> None:
    cycles = find_cycles(import_graph(_module_files()))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_loop_through_a_lazy_import() -> None:
    sources = {"a.x": "from a.y import f\n", "a.y": "def f():\n    import a.z\n",
               "a.z": "from a import x\n", "a": ""}
    known = set(sources)
    graph = {name: _imported_modules(ast.parse(src), name, name == "a", known)
             for name, src in sources.items()}
    assert find_cycles(graph) == [["a.x", "a.y", "a.z"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def room_table() -> dict[str, str]:
    """docs/architecture.md's "Rooms as built": each folder a row names -> the row's text."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Rooms as built", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    return {name.strip("`/ "): owns for names, owns in rows for name in names.split(",")}


def test_the_room_table_matches_the_tree() -> None:
    """docs/architecture.md's "Rooms as built" names every room and every sub-room, and only
    folders that exist: rooms under pdcluster/, the rest (k8s/, tests/, …) at the root. The
    rooms in the tree are the ones this file has rules for."""
    named = set(room_table())
    rooms = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    subrooms = {p.parent.relative_to(PACKAGE).as_posix()
                for p in PACKAGE.glob("*/*/__init__.py")}
    assert rooms == ROOMS, f"rooms without import rules here: {sorted(rooms - ROOMS)}; " \
                           f"rules for rooms not in the tree: {sorted(ROOMS - rooms)}"
    assert not ROOMS - named, f"rooms missing from the table: {sorted(ROOMS - named)}"
    assert not subrooms - named, f"sub-rooms missing from the table: {sorted(subrooms - named)}"
    missing = [name for name in named
               if not (PACKAGE / name).is_dir() and not (REPO_ROOT / name).is_dir()]
    assert not missing, f"the table names folders that do not exist: {missing}"


@pytest.mark.parametrize("folder", ["router", "router/api", "router/routing", "router/sim",
                                    "router/planning"])
def test_the_router_rows_name_every_module(folder: str) -> None:
    """`ls router/<sub-room>` and its row of the table agree: each module is named there."""
    row = room_table()[folder]
    modules = {p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__"}
    unnamed = sorted(m for m in modules if f"`{m}`" not in row)
    assert modules and not unnamed, f"{folder}/ modules its row does not name: {unnamed}"


# ---- router's sub-rooms ----------------------------------------------------------------------

# The serving path never imports the simulator; the routing decision never imports the HTTP
# framework or the API side; the simulator runs the real policy but serves nothing.
SUBROOM_FORBIDDEN: dict[str, frozenset[str]] = {
    "router/api": frozenset({"pdcluster.router.sim"}),
    "router/routing": frozenset({"aiohttp", "pdcluster.router.api", "pdcluster.router.sim"}),
    "router/sim": frozenset({"aiohttp", "pdcluster.router.api"}),
    # pure decisions: neither the HTTP side, nor the links and sockets, nor the simulator
    "router/planning": frozenset({"aiohttp", "zmq", "grpc", "pdcluster.router.api",
                                  "pdcluster.router.sim", "pdcluster.router.routing"}),
}


def subroom_violations(source: str, filename: str, forbidden: frozenset[str]) -> list[str]:
    return [f"{filename}:{line} imports {name}"
            for line, name in _imported_names(ast.parse(source, filename=filename))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize("subroom", sorted(SUBROOM_FORBIDDEN))
def test_router_subrooms_keep_to_their_job(subroom: str) -> None:
    files = sorted(p for p in (PACKAGE / subroom).rglob("*.py") if "__pycache__" not in p.parts)
    assert files, subroom
    violations = []
    for path in files:
        violations += subroom_violations(path.read_text(encoding="utf-8"),
                                         str(path.relative_to(REPO_ROOT)),
                                         SUBROOM_FORBIDDEN[subroom])
    assert not violations, "forbidden imports:\n" + "\n".join(violations)


def test_router_top_level_modules_import_no_subroom_but_routing() -> None:
    """config, errors and metrics are shared by api and routing: they may use routing's pure
    types (config names the policy), never the HTTP side or the simulator."""
    forbidden = frozenset({"aiohttp", "pdcluster.router.api", "pdcluster.router.sim"})
    violations = []
    for path in sorted((PACKAGE / "router").glob("*.py")):
        violations += subroom_violations(path.read_text(encoding="utf-8"), path.name, forbidden)
    assert not violations, violations


def test_subroom_check_catches_an_offender() -> None:
    source = "from aiohttp import web\nfrom pdcluster.router.sim.replay import run\n" \
             "import pdcluster.router.simple\n"
    assert subroom_violations(source, "x.py", SUBROOM_FORBIDDEN["router/routing"]) == [
        "x.py:1 imports aiohttp", "x.py:2 imports pdcluster.router.sim.replay"]


# ---- engine's sub-rooms ----------------------------------------------------------------------

# engine/ in layers, each importing only the layers below it (docs/architecture.md): the
# torch-free core at the bottom, beside the kernels; KV storage and sampling on the core; the
# models on the kernels and KV storage; the runner on all of those; speculative decoding on the
# runner; the engine itself (the top-level modules) on everything.
ENGINE_LAYERS: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "kernels": frozenset(),
    "kv": frozenset({"core"}),
    "sample": frozenset({"core"}),
    "models": frozenset({"core", "kv", "kernels"}),
    "runner": frozenset({"core", "kv", "kernels", "models", "sample"}),
    "spec_decode": frozenset({"core", "kv", "kernels", "models", "sample", "runner"}),
}


def _engine_module_names(tree: ast.AST) -> list[tuple[int, str]]:
    """`_imported_names`, with `from pdcluster.engine import x` read as `pdcluster.engine.x`."""
    found = []
    for line, name in _imported_names(tree):
        if name != "pdcluster.engine":
            found.append((line, name))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 \
                and node.module == "pdcluster.engine":
            found += [(node.lineno, f"pdcluster.engine.{alias.name}") for alias in node.names]
    return sorted(found)


def engine_layer_violations(source: str, filename: str, layer: str) -> list[str]:
    """'file:line imports name' for each engine module outside the layers `layer` may use."""
    allowed = ENGINE_LAYERS[layer] | {layer}
    found = []
    for line, name in _engine_module_names(ast.parse(source, filename=filename)):
        parts = name.split(".")
        if parts[:2] == ["pdcluster", "engine"] and (len(parts) < 3 or parts[2] not in allowed):
            found.append(f"{filename}:{line} imports {name}")
    return found


@pytest.mark.parametrize("layer", sorted(ENGINE_LAYERS))
def test_engine_subrooms_import_only_the_layers_below(layer: str) -> None:
    files = sorted(p for p in (PACKAGE / "engine" / layer).rglob("*.py")
                   if "__pycache__" not in p.parts)
    assert files, layer
    violations = []
    for path in files:
        violations += engine_layer_violations(path.read_text(encoding="utf-8"),
                                              str(path.relative_to(REPO_ROOT)), layer)
    assert not violations, "imports against engine's layers:\n" + "\n".join(violations)


def test_every_engine_subroom_has_a_layer_rule() -> None:
    subrooms = {p.parent.name for p in (PACKAGE / "engine").glob("*/__init__.py")}
    assert subrooms == set(ENGINE_LAYERS)


def test_engine_layer_check_catches_an_offender() -> None:
    source = ("from pdcluster.engine.runner.model_runner import ModelRunner\n"
              "from pdcluster.engine.core.request import Request\n"
              "import pdcluster.engine.llm_engine\n"
              "from pdcluster.engine import LLM, kernels\n")
    assert engine_layer_violations(source, "x.py", "sample") == [
        "x.py:1 imports pdcluster.engine.runner.model_runner",
        "x.py:3 imports pdcluster.engine.llm_engine",
        "x.py:4 imports pdcluster.engine.LLM",
        "x.py:4 imports pdcluster.engine.kernels"]


# ---- module paths named in strings ---------------------------------------------------------

_BARE_MODULE_PATH = re.compile(
    rf"^({'|'.join(sorted(ROOMS))})\.[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")


def _names_a_module(text: str) -> bool:
    """Whether `room.a.b[:attr]` starts with a real module of the package below its room
    (`engine.models.llama`), as opposed to a file name or a metric (`cluster.yaml`)."""
    parts = text.split(":")[0].split(".")
    folder = PACKAGE / parts[0]
    for part in parts[1:]:
        if (folder / f"{part}.py").is_file():
            return True
        folder = folder / part
        if not (folder / "__init__.py").is_file():
            return False
    return True


def bare_module_path_strings(source: str, filename: str) -> list[str]:
    """'file:line: "x"' for each string literal that names a module of a room without the
    package (`"engine.models.llama:CausalLM"`): importlib, Ray, `-m` and monkeypatch targets
    resolve such a name only where the repository root happens to be on sys.path."""
    return [f"{filename}:{node.lineno}: {node.value!r}"
            for node in ast.walk(ast.parse(source, filename=filename))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and _BARE_MODULE_PATH.match(node.value) and _names_a_module(node.value)]


def test_no_module_path_string_names_a_bare_room() -> None:
    files = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts
                   and not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))
    files += sorted((REPO_ROOT / "tests").rglob("*.py"))
    found = []
    for path in files:
        found += bare_module_path_strings(path.read_text(encoding="utf-8"),
                                          str(path.relative_to(REPO_ROOT)))
    assert not found, "name these pdcluster.<room>…:\n" + "\n".join(found)


def test_module_path_string_check_catches_an_offender() -> None:
    source = 'A = "engine.models.llama:CausalLM"\nB = "pdcluster.engine.llm"\n' \
             'C = "node.server.NodeServer"\nD = "router_bench"\n' \
             'E = "engine.tok_s is a metric name"\nF = "cluster.yaml"\nG = "engine.tok_s"\n'
    assert bare_module_path_strings(source, "x.py") == [
        "x.py:1: 'engine.models.llama:CausalLM'", "x.py:3: 'node.server.NodeServer'"]
