"""docs/porting.md followed as a user follows it: `cp ddp_template.py mine.py`, then each section's code blocks
put into the copy as the guide says (a function of the same name replaced, a new one added above the
`# ---- beyond the lesson` line, an import added to the imports), launched under torchrun at 2 processes on
CPU with gloo. Each port must learn, agree across replicas, and match its world-of-one run where the maths
says it must. The template itself: flags, exact validation, exact resume, DETAIL."""
import ast
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
GUIDE = ROOT / "docs" / "porting.md"
BANNER = "# ---- beyond the lesson"


def blocks(heading):
    """The ```python blocks of the guide's section under `heading` (to the next heading of its level or above)."""
    text = GUIDE.read_text()
    level = re.match(r"#+", heading).group()
    start = text.index(f"\n{heading}\n")
    end = re.search(rf"\n#{{1,{len(level)}}} ", text[start + len(heading) + 2:])
    section = text[start:start + len(heading) + 2 + end.start()] if end else text[start:]
    found = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert found, f"no python block under {heading}"
    return found


def port(source, *code):
    """The guide's rule: each top-level def/class/assignment of a block replaces the template's of the same
    name, or goes above the `# ---- beyond the lesson` line; each import goes after the template's imports."""
    for block in code:
        tree = ast.parse(block)
        lines = block.splitlines(keepends=True)
        for node in tree.body:
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            piece = "".join(lines[first - 1:node.end_lineno])
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if piece not in source:
                    at = source.index("\n\n", source.index("\nfrom torch.utils.data import")) + 1
                    source = source[:at] + piece + source[at:]
                continue
            name = node.targets[0].id if isinstance(node, ast.Assign) else node.name
            template = ast.parse(source)
            old = next((n for n in template.body if (n.targets[0].id if isinstance(n, ast.Assign) and
                        isinstance(n.targets[0], ast.Name) else getattr(n, "name", None)) == name), None)
            src_lines = source.splitlines(keepends=True)
            if old is not None:
                start = min([old.lineno] + [d.lineno for d in getattr(old, "decorator_list", [])]) - 1
                source = "".join(src_lines[:start]) + piece + "".join(src_lines[old.end_lineno:])
            else:
                at = source.index(f"\n{BANNER}") + 1
                source = source[:at] + piece + "\n\n" + source[at:]
    return source


def write_port(tmp_path, *code, name="mine.py"):
    mine = tmp_path / name
    mine.write_text(port((ROOT / "ddp_template.py").read_text(), *code))
    ast.parse(mine.read_text())
    return mine


def read(path):
    return json.loads(Path(path).read_text())
