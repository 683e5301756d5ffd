"""The file-level import cycles of the Rust core: python3 scripts/import_cycles.py [src]

Each `crate::a::b`, `super::a` or `self::a` path in a file (outside its `#[cfg(test)] mod tests`)
is an edge to the file that defines the longest module prefix of it (a/b.rs or a/b/mod.rs);
every strongly connected set of more than one file is printed. bridge.rs <-> ffi.rs is the one
that cxx requires (the bridge module names the functions that implement it)."""

import os
import re
import sys


def modules(root: str) -> dict[tuple, str]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".rs"):
                path = os.path.relpath(os.path.join(d, f), root)
                mod = tuple(path[:-3].split("/"))
                out[mod[:-1] if mod[-1] in ("mod", "lib") else mod] = path
    return out


def edges(root: str, mods: dict[tuple, str]) -> dict[str, set]:
    def resolve(parts):
        for n in range(len(parts), 0, -1):
            if tuple(parts[:n]) in mods:
                return mods[tuple(parts[:n])]
        return None

    out = {p: set() for p in mods.values()}
    for mod, path in mods.items():
        with open(os.path.join(root, path)) as f:
            text = re.sub(r"#\[cfg\(test\)\]\s*mod tests \{.*", "", f.read(), flags=re.S)
        for m in re.finditer(r"\b(crate|super|self)((?:::\w+)+)", text):
            base = {"crate": [], "super": list(mod[:-1]), "self": list(mod)}[m.group(1)]
            target = resolve(base + m.group(2).strip(":").split("::"))
            if target and target != path:
                out[path].add(target)
    return out


def cycles(graph: dict[str, set]) -> list[list[str]]:
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "src"
    found = cycles(edges(root, modules(root)))
    print(f"{len(found)} file-level import cycles in {root}/")
    for c in found:
        print("  " + " <-> ".join(c))
