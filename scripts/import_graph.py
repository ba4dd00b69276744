"""kdist's import graph: its floors, cycles and imports that point up a layer.

`python scripts/import_graph.py [PACKAGE_DIR]` reads every module's imports of
kdist modules with `ast` (at the top and inside functions alike; not those under
`if TYPE_CHECKING:`, which never run), then prints:

- the floors: a module's floor is 0 if it imports no kdist module, else one
  above the highest module it imports (cycles are condensed first);
- every import cycle (a strongly connected group of modules);
- every import against `LAYERS`, the layer order written below (a lower layer
  importing a higher one), and every import of a kdist module inside a
  function (in kdist, each defers a framework or NumPy until a command has
  read its flags or a child process has set its environment).

Exits 1 if there is a cycle or an import against the layers, so the `lint`
session of noxfile.py fails on either. Imports no framework.
"""

import ast
import os
import sys

# Bottom to top: a module may import its own layer and the layers below it. The
# package `kdist` itself is its public API: it imports nothing when loaded and loads
# each name's module on first use, so importing it costs a layer nothing.
LAYERS = (
    ("kdist", "kdist.errors", "kdist.tree", "kdist.records", "kdist.precision",
     "kdist.checks", "kdist.config", "kdist.hints", "kdist.datasets.sizes"),
    ("kdist.runtime",),
    ("kdist.workers", "kdist.checkpoints", "kdist.step", "kdist.random"),
    ("kdist.inputs", "kdist.datasets", "kdist.models"),
    ("kdist.engines",),
    ("kdist.loop",),
    ("kdist.cli",),
    ("kdist.bench",),
    ("kdist.__main__",),
)


def layer_of(module):
    """The index in `LAYERS` of the longest prefix of `module` listed there."""
    best, found = -1, None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    return found


def modules(root):
    """{module name: path} of every .py file under the package folder `root`."""
    found = {}
    base = os.path.dirname(os.path.abspath(root))
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(path, module, known):
    """[(imported kdist module, line, inside a function)] of the file at `path`."""
    tree = ast.parse(open(path).read(), path)
    found = []

    def visit(children, nested):
        for child in children:
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                visit(child.orelse, nested)  # Its body is for type checkers only.
                continue
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, inner) for a in child.names
                             if a.name in known)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:
                    full = f"{child.module}.{alias.name}"
                    target = full if full in known else child.module
                    if target in known:
                        found.append((target, child.lineno, inner))
            visit(ast.iter_child_nodes(child), inner)

    visit(ast.iter_child_nodes(tree), False)
    return [(target, line, inner) for target, line, inner in found if target != module]


def _is_type_checking(test):
    """Whether an `if` tests `TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def cycles(graph):
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for node in graph:
        if node not in index:
            connect(node)
    return groups


def floors(graph, groups):
    """{module: floor}, each cycle's modules sharing one floor."""
    group_of = {m: tuple(g) for g in groups for m in g}
    memo = {}

    def floor(node, seen=()):
        key = group_of.get(node, (node,))
        if key in memo:
            return memo[key]
        targets = {t for member in key for t in graph[member] if t not in key}
        memo[key] = 1 + max((floor(t) for t in targets), default=-1)
        return memo[key]

    return {node: floor(node) for node in graph}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    root = argv[0] if argv else os.path.join(os.path.dirname(__file__), "..", "kdist")
    known = modules(root)
    edges = {m: imports(path, m, known) for m, path in known.items()}
    graph = {m: sorted({t for t, _, _ in e}) for m, e in edges.items()}
    groups = cycles(graph)
    levels = floors(graph, groups)
    top = max(levels.values())
    print(f"{len(known)} modules, {sum(len(t) for t in graph.values())} imports, "
          f"{top + 1} floors, {len(groups)} cycles")
    for level in range(top, -1, -1):
        print(f"  floor {level}: {', '.join(sorted(m for m, f in levels.items() if f == level))}")
    for group in groups:
        print("cycle: " + " <-> ".join(group))
    against = [(m, t, line) for m, e in edges.items() for t, line, _ in e
               if None not in (layer_of(m), layer_of(t)) and layer_of(t) > layer_of(m)]
    for module, target, line in against:
        print(f"up a layer: {module} (line {line}) imports {target}")
    unlisted = sorted(m for m in known if layer_of(m) is None)
    for module in unlisted:
        print(f"not in LAYERS: {module}")
    for module, e in sorted(edges.items()):
        for target, line, inner in e:
            if inner:
                print(f"inside a function: {module} (line {line}) imports {target}")
    return 1 if groups or against or unlisted else 0


if __name__ == "__main__":
    sys.exit(main())
