"""The package's shape, as docs/ARCHITECTURE.md describes it: checked on the source, not by convention.

- no import cycles among qwenkit modules (function-level and type-only imports count: a cycle hidden in a
  function or an annotation still couples the two modules);
- no module of the package or of ``benchmarks/`` reaches 440 lines (split by job, not trimmed);
- at most 10 imports of qwenkit modules inside functions, each with a reason on its line;
- argparse only at the entry points (the CLI and the per-rank ``python -m qwenkit.engine.run.rank``);
- the training kit never imports the notebook layer.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import package_modules

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qwenkit"
MAX_MODULE_LINES = 440  # a module this long holds more than one job
MAX_FUNCTION_IMPORTS = 10  # the CLI's, one per subcommand (sweep the ninth, vllm-serve the tenth)
ENTRY_POINTS = {"qwenkit.cli", "qwenkit.engine.run.rank"}


MODULES = package_modules()


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The qwenkit modules an import statement loads (``from qwenkit import x``: ``qwenkit.x`` when a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "qwenkit"]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: None if is_package else -1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    if base.split(".")[0] != "qwenkit":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _imports() -> list[tuple[str, int, str, bool, str]]:
    """``(module, line, imported module, inside a function, source line)`` for every qwenkit import."""
    rows = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        is_package = path.name == "__init__.py"
        todo: list[tuple[ast.AST, bool]] = [(ast.parse(source), False)]
        while todo:
            node, in_function = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _imported(child, module, is_package):
                        rows.append((module, child.lineno, target, in_function, lines[child.lineno - 1]))
                nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                todo.append((child, nested))
    return rows


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                return [*stack[stack.index(v):], v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    """Type-only imports (``if TYPE_CHECKING:``) count too: an annotation that needs the other module
    couples the two as much as a call does."""
    edges: dict[str, set[str]] = {}
    for module, _, target, _, _ in _imports():
        if target != module:
            edges.setdefault(module, set()).add(target)
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_module_holds_more_than_one_job_by_size():
    sources = [*MODULES.values(), *(ROOT / "benchmarks").glob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) >= MAX_MODULE_LINES}
    assert not long, f"modules of {MAX_MODULE_LINES} lines or more (split them by job): {long}"


def test_few_function_level_imports_each_with_a_reason():
    inside = sorted({(m, line, text.strip()) for m, line, _, in_fn, text in _imports() if in_fn})
    listing = "\n".join(f"{m}:{line}: {text}" for m, line, text in inside)
    assert len(inside) <= MAX_FUNCTION_IMPORTS, f"{len(inside)} function-level qwenkit imports:\n{listing}"
    unexplained = [f"{m}:{line}: {text}" for m, line, text in inside if "#" not in text]
    assert not unexplained, "function-level imports need a one-line reason as a comment:\n" + "\n".join(unexplained)


def test_argparse_only_at_entry_points():
    users = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module == "argparse" or "argparse" in names:
                users.add(module)
    assert users <= ENTRY_POINTS, f"argparse outside the entry points: {sorted(users - ENTRY_POINTS)}"


def test_the_kit_never_imports_the_notebook_layer():
    upward = sorted(
        f"{m}:{line}: {text.strip()}"
        for m, line, target, _, text in _imports()
        if not m.startswith("qwenkit.notebooks") and m != "qwenkit.cli" and target.startswith("qwenkit.notebooks")
    )
    assert not upward, "the training kit imports the notebook layer:\n" + "\n".join(upward)



# The floors, lowest first: a module may import its own floor and the floors this table names.
# ``qwenkit`` is the package's own ``__init__`` (the version); ``entry`` are cli, launch, torchrun, cluster.
FLOORS = {
    "leaf": set(),  # config, device, records, rundir, errors
    "patches": {"leaf"},
    "model": {"leaf"},
    "distributed": {"leaf", "model"},
    "data": {"leaf", "model"},
    "engine": {"leaf", "patches", "model", "distributed", "data"},
    "entry": {"leaf", "patches", "model", "distributed", "data", "engine", "bench", "sweep", "notebooks"},
    "bench": {"leaf", "patches", "model", "distributed", "data"},
    # sweeps of whole runs (every trial passes engine.prespawn's checks, as every `qwenkit train` does)
    "sweep": {"leaf", "patches", "model", "distributed", "data", "engine"},
    "notebooks": {"leaf", "patches", "model", "distributed", "data", "engine", "bench", "sweep"},
}
# the leaf reads the family registry, the one list of families (model.name's allowed values): a
# light module of the standard library and the module-path rule only (test_the_family_table_is_light)
FAMILY_TABLE = ("qwenkit.model.families.registry", "qwenkit.model.families.entry", "qwenkit.model.modules",
                "qwenkit.model.losses.registry")  # and the one list of policy losses (grpo.loss_type's values)
# data needs the model floor's light modules (paths, processor, tokens, loss constants), never its code.
MODEL_CODE = ("qwenkit.model.families.qwen2_5_vl", "qwenkit.model.families.build")


def floor_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] in ("cli", "launch", "torchrun", "cluster"):
        return "entry"
    if parts[1] in ("config", "device", "records", "rundir", "errors"):
        return "leaf"
    return parts[1]


def test_every_module_has_a_floor():
    unknown = sorted(m for m in MODULES if floor_of(m) not in FLOORS and floor_of(m) != "package")
    assert not unknown, f"modules outside the floors of docs/ARCHITECTURE.md: {unknown}"


def test_imports_go_down_the_floors():
    upward = []
    for m, line, target, _, text in _imports():
        a, b = floor_of(m), floor_of(target)
        if a == b or b == "package" or (a == "leaf" and target in FAMILY_TABLE):
            continue
        if b not in FLOORS.get(a, set()) or (a == "data" and target.startswith(MODEL_CODE)):
            upward.append(f"{m}:{line}: {text.strip()}  ({a} -> {b})")
    assert not upward, "imports against the floors of docs/ARCHITECTURE.md:\n" + "\n".join(upward)


def test_the_family_table_is_light():
    """What the leaf may read of the model floor imports nothing of qwenkit above it, nor torch or transformers."""
    for module in FAMILY_TABLE:
        tree = ast.parse(MODULES[module].read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        heavy = {i for i in imported if i.split(".")[0] in ("torch", "transformers")}
        above = {i for i in imported if i.startswith("qwenkit.") and i not in FAMILY_TABLE}
        assert not heavy and not above, f"{module} imports {sorted(heavy | above)}"


def test_floor_check_catches_an_upward_import():
    assert "engine" not in FLOORS["model"] and "model" in FLOORS["data"]
    assert floor_of("qwenkit.engine.run.train") == "engine" and floor_of("qwenkit.config.train") == "leaf"
    assert floor_of("qwenkit.launch") == "entry" and floor_of("qwenkit.data.check") == "data"
    assert floor_of("qwenkit.sweep.scheduler") == "sweep" and "entry" not in FLOORS["sweep"]


# A checkpoint's family is resolved in qwenkit/model/ only (qwenkit.model.families.spec: once, then passed down):
# qwenkit.model.families.registry's lookups that read a checkpoint's config.json, and reads of that file
FAMILY_LOOKUPS = ("resolve", "of_directory", "_model_type")


def _family_lookups(source: str) -> list[str]:
    """Where ``source`` finds a family from disk: a call of :data:`FAMILY_LOOKUPS` on the family module
    (however imported), or ``config.json`` read (``.read_text()`` / ``.open()`` / ``open(...)``)."""
    tree = ast.parse(source)
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "qwenkit.model":
            aliases |= {a.asname or a.name for a in node.names if a.name == "family"}
        if isinstance(node, ast.ImportFrom) and node.module == "qwenkit.model.families.registry":
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in FAMILY_LOOKUPS]

    def names_config(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Constant) and n.value == "config.json" for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr in FAMILY_LOOKUPS:
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        if isinstance(node, ast.Attribute) and node.attr in ("read_text", "read_bytes", "open") and names_config(node.value):
            found.append(f"line {node.lineno}: reads config.json")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open" and any(map(names_config, node.args)):
            found.append(f"line {node.lineno}: opens config.json")
    return found


def test_only_the_model_floor_finds_a_checkpoints_family():
    """STYLE 16, resolve once and pass down: outside ``qwenkit/model/`` a module receives the family
    (:class:`qwenkit.model.families.spec.ModelSpec`, the processor's entry, a built model's own config), it
    does not look it up from a checkpoint's ``config.json`` again."""
    found = {m: hits for m, path in MODULES.items() if not m.startswith("qwenkit.model.")
             and (hits := _family_lookups(path.read_text()))}  # fmt: skip
    assert not found, f"family looked up from disk outside qwenkit/model/ (take a qwenkit.model.families.spec.ModelSpec): {found}"
    # the finder: each way of looking it up, and existence checks and other files left alone
    assert _family_lookups("from qwenkit.model import family as f\nf.resolve(name, path)") == ["line 2: f.resolve"]
    assert _family_lookups("from qwenkit.model.families.registry import of_directory") == ["line 1: imports of_directory"]
    assert _family_lookups("json.loads((path / 'config.json').read_text())") == ["line 1: reads config.json"]
    assert _family_lookups("open(os.path.join(d, 'config.json'))") == ["line 1: opens config.json"]
    assert _family_lookups("(p / 'config.json').is_file(); (p / 'adapter_config.json').read_text()") == []


def _tree_listing() -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's package tree: each folder's line (``├── data/  a b c  what they do``) to the
    module names it lists (the words before the first gap of two spaces; ``samples(01)`` names ``samples``)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    tree = text[text.index("```\nqwenkit/") : text.index("```", text.index("```\nqwenkit/") + 3)]
    listing = {}
    for line in tree.splitlines():
        match = re.match(r"^[\s│]*[├└]── ([a-z_]+)/\s+(.*)$", line)
        if match:
            names = re.split(r"\s{2,}", match[2].strip())[0].split()
            listing[match[1]] = {re.sub(r"\(.*\)$", "", n).removesuffix(".py") for n in names}
    return listing


def test_the_tree_of_the_architecture_page_lists_every_module():
    """The newcomer's first page stays true: every module of each folder the tree shows is on its line, and
    every name on a line is a module there (``config/``'s line lists the top-level leaves instead)."""
    listing = _tree_listing()
    missing, stale = [], []
    for folder, names in listing.items():
        if folder == "config":
            continue
        path = next(p for p in [PACKAGE / folder, *(PACKAGE / room / folder for room in ("engine", "model", "config"))] if p.is_dir())
        modules = {p.stem for p in path.glob("*.py") if p.stem != "__init__"}
        missing += [f"{folder}/{m}" for m in sorted(modules - names)]
        stale += [f"{folder}/{n}" for n in sorted(names - modules)]
    assert {"engine", "run", "objectives", "rollouts", "generation", "checkpoints", "data", "model", "families", "losses",
            "tiny", "rules"} <= set(listing)
    assert not missing and not stale, f"docs/ARCHITECTURE.md's tree: missing {missing}, not modules {stale}"
