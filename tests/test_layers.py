"""The import layering of ``pagedllm/``, read from the source with ``ast`` (nothing is imported).

Every module sits on a floor; a module imports modules of its own floor or of floors below,
never above, at module level or inside a function. Floors, lowest first:

  utils       helpers of the standard library's kind (channels, child processes, ports, CPU
              lists, pinned host rings): they know nothing of the engine.
  params      what a request or an engine asks for and gets back, as plain validated data
              (``SamplingParams``, ``BeamSearchParams``, ``StructuredOutputsParams``,
              ``SpeculativeConfig``, ``RequestOutput``): everything above reads them.
  config      ``EngineArgs`` -> ``EngineConfig``: the params resolved into frozen configs that
              every part of the engine is built from.
  features    the host side of features the scheduler drives: draft proposers and grammar
              compile, matchers and the grammar worker process (DESIGN.md §4: grammar
              bookkeeping lives in its own manager, which the scheduler calls).
  core        the scheduler and the KV-cache managers, pure Python and numpy (DESIGN.md §2).
  layout      ``kv_layout``: the one object that owns slot arithmetic and KV writes, over the
              core's KV-cache specs; kernels and backends ask it (DESIGN.md §4).
  ops         kernels (Triton; C++ on the CPU), each beside its PyTorch reference.
  layers      what the model is built of, over the kernels: attention backends, process groups,
              the sampler, and the device side of features (the grammar bitmask applied to the
              logits, n-gram drafts on the device).
  model       the models and their loaders; a model knows nothing of KV-Compress or the runner.
  worker      the model runner, its input batch and CUDA graphs, the KV seam's worker hooks,
              and the executors that run it.
  kvcompress  KV-Compress's worker role (per-head caches, scores, eviction, its attention
              backends and graphs), built on the worker's hooks; the runner reaches it only
              through the KV connector registry (``core/sched/connector.py``, a lazy factory).
  engine      ``EngineCore`` and its front ends (in-process, async, multi-process, data
              parallel), input and output processing.
  api         what a user runs: ``LLM``, the OpenAI server, the CLI, the benchmarks, the
              Prometheus metrics, and the package root's lazy exports.

Exceptions are few and named: ``LAZY_FACTORIES`` (a function that imports a higher floor when
it is called, documented as a lazy factory where it is written), ``ALLOWED_CYCLES`` (a factory
and the backends it builds), and ``PENDING`` (known upward imports in files another change
owns; that change empties it). Imports under ``if TYPE_CHECKING:`` are for types only and are
not counted.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"

# (floor, module prefixes), lowest first; a module takes the floor of its longest prefix (the
# root ``pagedllm`` only matches the package's own ``__init__``). Reasons: the docstring above.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("utils", ("pagedllm.utils",)),
    (
        "params",
        (
            "pagedllm.sampling_params",
            "pagedllm.beam_search",
            "pagedllm.outputs",
            "pagedllm.structured_output.params",
            "pagedllm.spec_decode.config",
            "pagedllm.core.kv_transfer.config",
            "pagedllm.lora.request",
        ),
    ),
    ("config", ("pagedllm.config", "pagedllm.lora", "pagedllm.lora.config")),
    (
        "features",
        (
            "pagedllm.spec_decode",
            "pagedllm.structured_output",
            "pagedllm.lora.peft_loader",
            "pagedllm.lora.registry",
        ),
    ),
    ("core", ("pagedllm.core",)),
    ("layout", ("pagedllm.kv_layout",)),
    ("ops", ("pagedllm.ops", "pagedllm.lora.ops")),
    (
        "layers",
        (
            "pagedllm.attention",
            "pagedllm.distributed",
            "pagedllm.sample",
            "pagedllm.structured_output.bitmask",
            "pagedllm.spec_decode.ngram_gpu",
            "pagedllm.lora.batch",
        ),
    ),
    ("model", ("pagedllm.model", "pagedllm.lora.layers")),
    ("worker", ("pagedllm.worker", "pagedllm.lora.worker")),
    ("kvcompress", ("pagedllm.kvcompress",)),
    ("engine", ("pagedllm.engine",)),
    (
        "api",
        (
            "pagedllm",
            "pagedllm.entrypoints",
            "pagedllm.dashboard",
            "pagedllm.bench",
            "pagedllm.metrics",
            "pagedllm.metrics_reader",
        ),
    ),
]

# (module, function) whose body may import a higher floor: each says "lazy factory" and why in
# its docstring or a comment. Keep this list short; prefer moving the code down.
LAZY_FACTORIES: set[tuple[str, str]] = {
    # EngineArgs reads the model's files (HF config, tokenizer, the packaged default model)
    # through the model package, which imports torch: importing the config stays cheap
    ("pagedllm.config", "EngineArgs.create_engine_config"),
    ("pagedllm.config", "_draft_model_config"),
    ("pagedllm.config", "engine_args_from"),
    ("pagedllm.lora.config", "lora_config_from"),  # the same, for LoRA's architecture check
}

# Strongly connected components of the import graph (module-level and function-level imports
# together) allowed to remain, each a factory and the backends it builds: the factory imports
# a backend when it is asked for it, and the backends import the factory's shared helpers.
ALLOWED_CYCLES: list[frozenset[str]] = [
    # make_proposer builds the n-gram and suffix proposers, which share its check_k
    frozenset(
        {
            "pagedllm.spec_decode.proposer",
            "pagedllm.spec_decode.ngram",
            "pagedllm.spec_decode.suffix",
        }
    ),
    # make_executor builds the multiprocess and Ray executors, which subclass its Executor
    frozenset(
        {
            "pagedllm.worker.executor",
            "pagedllm.worker.multiproc_executor",
            "pagedllm.worker.ray_executor",
        }
    ),
]

# Known upward imports waiting for a change that removes them, as (module, imported module);
# an entry that no longer occurs fails the test, so the set only shrinks.
PENDING: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    function: str | None  # qualified name of the enclosing function; None: module level


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector:
    """The ``pagedllm`` imports of one module, each with its enclosing function's qualified
    name (``EngineArgs.create_engine_config``; None at module level, class bodies included)."""

    def __init__(self, module: str, is_package: bool, modules: dict[str, Path]) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.modules = modules
        self.found: list[Import] = []

    def targets(self, node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name.split(".")[0] == "pagedllm"]
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        if base.split(".")[0] != "pagedllm":
            return []
        # ``from pagedllm.x import y``: the module pagedllm.x.y if there is one, else pagedllm.x
        return [
            f"{base}.{a.name}" if f"{base}.{a.name}" in self.modules else base for a in node.names
        ]

    def walk(self, nodes: list[ast.AST], scope: list[str], function: str | None) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in self.targets(node):
                    self.found.append(Import(self.module, target, node.lineno, function))
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                self.walk(node.orelse, scope, function)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [*scope, node.name]
                self.walk(node.body, inner, ".".join(inner))
            elif isinstance(node, ast.ClassDef):
                self.walk(node.body, [*scope, node.name], function)
            else:
                children = [
                    c
                    for c in ast.iter_child_nodes(node)
                    if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case))
                ]
                self.walk(children, scope, function)


def _imports() -> list[Import]:
    modules = _modules()
    out: list[Import] = []
    for name, path in modules.items():
        collector = _Collector(name, path.name == "__init__.py", modules)
        collector.walk(ast.parse(path.read_text(), str(path)).body, [], None)
        out += [i for i in dict.fromkeys(collector.found) if i.target != name]
    return out


def _floor_of(module: str) -> tuple[int, str]:
    best: tuple[int, int, str] | None = None  # (prefix length, floor index, floor name)
    for index, (floor, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            hit = module == p or (p != "pagedllm" and module.startswith(p + "."))
            if hit and (best is None or len(p) > best[0]):
                best = (len(p), index, floor)
    assert best is not None, f"{module} is on no floor: add it to FLOORS in {__file__}"
    return best[1], best[2]


def _cycles(edges: set[tuple[str, str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(graph[v]):
                work.append((v, i + 1))
                w = graph[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            for w in graph[v]:
                if w in on_stack:
                    low[v] = min(low[v], low[w])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def _describe(cycle: frozenset[str], edges: set[tuple[str, str]]) -> str:
    inside = sorted((a, b) for a, b in edges if a in cycle and b in cycle)
    return "\n".join(f"    {a} -> {b}" for a, b in inside)


def test_every_module_is_on_a_floor() -> None:
    for module in _modules():
        _floor_of(module)


def test_no_module_imports_a_higher_floor() -> None:
    upward: dict[tuple[str, str], list[Import]] = {}
    for imp in _imports():
        if _floor_of(imp.target)[0] > _floor_of(imp.importer)[0]:
            upward.setdefault((imp.importer, imp.target), []).append(imp)
    excused_by_factory = set()
    problems = []
    for pair, found in sorted(upward.items()):
        if pair in PENDING:
            continue
        for imp in found:
            key = (imp.importer, imp.function or "")
            if key in LAZY_FACTORIES:
                excused_by_factory.add(key)
                continue
            where = f"in {imp.function}()" if imp.function else "at module level"
            problems.append(
                f"  {imp.importer} ({_floor_of(imp.importer)[1]}) imports {imp.target} "
                f"({_floor_of(imp.target)[1]}) {where}, line {imp.line}"
            )
    order = " < ".join(floor for floor, _ in FLOORS)
    assert not problems, (
        f"imports of a higher floor (floors: {order}); move the code down, or (a factory "
        f"that must import lazily) add it to LAZY_FACTORIES:\n" + "\n".join(problems)
    )
    stale = sorted(set(PENDING) - set(upward))
    assert not stale, f"PENDING entries that no longer occur, remove them: {stale}"
    unused = sorted(LAZY_FACTORIES - excused_by_factory)
    assert not unused, f"LAZY_FACTORIES entries that import nothing above, remove them: {unused}"


def test_lazy_factories_say_so() -> None:
    """Each allowed lazy factory says where it is written that it is one, and why."""
    modules = _modules()
    for module, function in sorted(LAZY_FACTORIES):
        tree = ast.parse(modules[module].read_text())
        node: ast.AST | None = tree
        for part in function.split("."):
            body = getattr(node, "body", [])
            node = next(
                (n for n in body if getattr(n, "name", None) == part and hasattr(n, "body")), None
            )
            assert node is not None, f"{module}: no {function}"
        source = " ".join((ast.get_source_segment(modules[module].read_text(), node) or "").split())
        assert "lazy factory" in source.lower(), (
            f"{module}.{function} imports a higher floor: its docstring or a comment must say "
            "it is a lazy factory and why"
        )


def test_import_cycles() -> None:
    imports = _imports()
    module_level = {(i.importer, i.target) for i in imports if i.function is None}
    found = _cycles(module_level)
    assert not found, "import cycles at module level:\n" + "\n\n".join(
        _describe(c, module_level) for c in found
    )
    every = {(i.importer, i.target) for i in imports}
    assert len(ALLOWED_CYCLES) <= 2
    extra = [c for c in _cycles(every) if c not in ALLOWED_CYCLES]
    assert not extra, (
        "import cycles (function-level imports included) beyond ALLOWED_CYCLES:\n"
        + "\n\n".join(_describe(c, every) for c in extra)
    )
