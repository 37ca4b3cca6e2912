"""Copy the harness block of ddp_gpus.py (the reference copy) into other scripts.

The block runs from the banner `# ---- harness: ...` to `# ---- end of harness ----`
and must be byte-identical in every scenario script (test_layout.py checks it). Edit it
in ddp_gpus.py, then run from the repository root:

    python3 tools/sync_harness.py                 # every top-level script that has a block
    python3 tools/sync_harness.py new_script.py   # also inserts it before `if __name__ == "__main__":`
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = "# =============================================================================\n# ---- harness:"
END = "# ---- end of harness ----\n"


def block_of(text):
    start = text.index(START)
    return start, text.index(END, start) + len(END)


def main(names):
    reference = (ROOT / "ddp_gpus.py").read_text()
    a, b = block_of(reference)
    block = reference[a:b]
    paths = [ROOT / n for n in names] or sorted(p for p in ROOT.glob("*.py") if START in p.read_text())
    for path in paths:
        text = path.read_text()
        if START in text:
            a, b = block_of(text)
            text = text[:a] + block + text[b:]
        else:
            entry = text.rindex('\nif __name__ == "__main__":')
            text = text[:entry].rstrip("\n") + "\n\n\n" + block + "\n" + text[entry:]
        path.write_text(text)
        print(f"synced {path.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
