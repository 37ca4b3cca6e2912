"""Copy into each script the recipes of recipes/harness.py (the reference copy) that it reaches.

A script's harness block runs from the banner `# ---- harness: ...` to `# ---- end of harness ----`
and holds the definitions that the script itself calls (its lesson, the part beyond the lesson, its
entry point), with everything those call in turn, and nothing a sibling needs: each byte for byte as
in the reference, in the reference's order, under its recipe's banner, with the imports they use
that the script above lacks. test_layout.py checks every block against this.
Edit the reference, then run from the repository root:

    python3 tools/sync_harness.py                 # every top-level script that has a block
    python3 tools/sync_harness.py new_script.py   # also inserts one before `if __name__ == "__main__":`
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "recipes" / "harness.py"
START = "# =============================================================================\n# ---- harness:"
END = "# ---- end of harness ----\n"
HEADER = f"""{START} recipes, each the same wherever it appears; not part of the lesson ----
# What makes the lesson above robust: the recipes of recipes/harness.py that this file uses, every definition byte for byte as there (a test compares them). A recipe can be
# lifted alone with the recipes its banner names; docs/recipes.md has the ones users lift most.
# =============================================================================
"""


def names_in(tree):
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def reference():
    """(imports: [(names bound, source)], definitions: {name: (banner, source, names used)}) in file order."""
    text = REFERENCE.read_text()
    lines, tree = text.splitlines(keepends=True), ast.parse(text)
    imports, definitions = [], {}
    for node in tree.body:
        source = "".join(lines[min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1:
                               node.end_lineno])
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(({(a.asname or a.name).split(".")[0] for a in node.names}, source))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            above = lines[:min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1]
            banner = next(line for line in reversed(above) if line.startswith("# ---- recipe:"))
            definitions[node.name] = (banner, source, names_in(node) - {node.name})
    return imports, definitions


def split(text):
    """(lesson, block, entry point) of a script."""
    start = text.index(START)
    end = text.index(END, start) + len(END)
    return text[:start], text[start:end], text[end:]


def reached(names, definitions):
    """The definitions `names` reach, and what those reach in turn."""
    todo, found = [n for n in names if n in definitions], set()
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += [n for n in definitions[name][2] if n in definitions]
    return found


def needed(name, definitions):
    """What the script `name` reaches from its lesson, its part beyond the lesson and its entry point."""
    lesson, _, entry = split((ROOT / name).read_text())
    return reached(names_in(ast.parse(lesson + entry)), definitions)


def render(name):
    """The harness block that script `name` must carry: what it reaches, with the imports that those
    definitions use and the lesson does not already make (a file imports a module once)."""
    imports, definitions = reference()
    chosen = needed(name, definitions)
    used = set().union(*(definitions[n][2] for n in chosen))
    lesson = set(split((ROOT / name).read_text())[0].splitlines(keepends=True))
    block, banner = HEADER + "".join(source for bound, source in imports if bound & used and source not in lesson), None
    for n, (recipe, source, _) in definitions.items():
        if n in chosen:
            block += "\n\n" + (recipe if recipe != banner else "") + source
            banner = recipe
    return block + END


def main(names):
    paths = [ROOT / n for n in names] or sorted(p for p in ROOT.glob("*.py") if START in p.read_text())
    for path in paths:
        text = path.read_text()
        if START not in text:
            entry = text.rindex('\nif __name__ == "__main__":')
            text = text[:entry].rstrip("\n") + "\n\n\n" + HEADER + END + "\n" + text[entry:]
            path.write_text(text)
        lesson, _, entry = split(text)
        path.write_text(lesson + render(path.name) + entry)
        print(f"synced {path.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
