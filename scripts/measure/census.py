"""The structure's census at two commits, side by side: what issue 28's closing table is made of.

    .venv/bin/python scripts/measure/census.py [BEFORE [AFTER]]    (defaults: fe1e288, HEAD)

Read from git objects, so neither commit needs checking out:
- lines per module of `contextpaw/` (the modules over 500 lines are the ones the issue names);
- the largest classes (AST span, from `class` to its last line; over 300 is the issue's limit);
- where per-flow state lives: containers keyed by a flow (a WeakKeyDictionary of flows, an LRU or
  dict keyed by a flow's id or a body's digest) and the `flow.metadata` keys written;
- how many times each fit option's name is spelled in `contextpaw/` (once in the option table is
  the goal; a second spelling in the docs' check does not count, as it is in tests/).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "contextpaw/"
OPTION = re.compile(r"""["'](contextpaw_[a-z_]+|keep_recent|keep_head|output_reserve)["']""")
FLOW_KEYED = re.compile(r"WeakKeyDictionary\[http\.HTTPFlow|self\.(carried|_found|_holders)(: [^=]+)? = |digest\(flow|blake2b\(.*request")
METADATA_KEY = re.compile(r"flow\.metadata\[([A-Za-z_\"'.]+)\]\s*=")


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout


def sources(rev: str) -> dict[str, str]:
    names = [n for n in git("ls-tree", "-r", "--name-only", rev, PACKAGE).split() if n.endswith(".py")]
    return {n.removeprefix(PACKAGE): git("show", f"{rev}:{n}") for n in names}


def census(rev: str) -> dict[str, object]:
    files = sources(rev)
    classes: list[tuple[int, str]] = []
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{name.removesuffix('.py')}.{node.name}"))
    options: Counter[str] = Counter()
    for text in files.values():
        options.update(OPTION.findall(text))
    state = sorted(
        {
            f"{name}:{i}"
            for name, text in files.items()
            for i, line in enumerate(text.splitlines(), 1)
            if FLOW_KEYED.search(line) and not line.lstrip().startswith(("#", '"'))
        }
    )
    metadata = sorted({key for text in files.values() for key in METADATA_KEY.findall(text)})
    return {
        "rev": git("rev-parse", "--short", rev).strip(),
        "lines": {n: t.count("\n") for n, t in files.items()},
        "classes": sorted(classes, reverse=True),
        "options": options,
        "state": state,
        "metadata": metadata,
    }


def main(argv: list[str]) -> int:
    before, after = census(argv[0] if argv else "fe1e288"), census(argv[1] if len(argv) > 1 else "HEAD")
    print(f"## Lines per module ({before['rev']} -> {after['rev']}; modules over 300 lines in either)\n")
    print("| module | before | after |\n|---|---|---|")
    lines_b, lines_a = before["lines"], after["lines"]
    for name in sorted(set(lines_b) | set(lines_a), key=lambda n: -max(lines_b.get(n, 0), lines_a.get(n, 0))):
        b, a = lines_b.get(name), lines_a.get(name)
        if max(b or 0, a or 0) > 300:
            print(f"| {name} | {b if b is not None else '-'} | {a if a is not None else '-'} |")
    print(
        f"\nmodules over 500 lines: {sum(v > 500 for v in lines_b.values())} -> {sum(v > 500 for v in lines_a.values())}; "
        f"package lines {sum(lines_b.values()):,} -> {sum(lines_a.values()):,} in {len(lines_b)} -> {len(lines_a)} modules"
    )
    print("\n## Largest classes (lines)\n\n| before | after |\n|---|---|")
    for (nb, cb), (na, ca) in zip(before["classes"][:8], after["classes"][:8]):
        print(f"| {cb} {nb} | {ca} {na} |")
    print(f"\nclasses over 300 lines: {sum(n > 300 for n, _ in before['classes'])} -> {sum(n > 300 for n, _ in after['classes'])}")
    print("\n## Per-flow state (containers keyed by a flow, and flow.metadata keys written)\n")
    for label, c in (("before", before), ("after", after)):
        print(f"- {label}: {len(c['state'])} places ({', '.join(c['state'])}); metadata keys: {', '.join(c['metadata'])}")
    print("\n## Option spellings in contextpaw/ (each fit option's name as a string)\n")
    names = sorted(set(before["options"]) | set(after["options"]))
    spelled_b = [before["options"][n] for n in names if before["options"][n]]
    spelled_a = [after["options"][n] for n in names if after["options"][n]]
    print(
        f"options: {len(spelled_b)} -> {len(spelled_a)}; spelled more than once: "
        f"{sum(n > 1 for n in spelled_b)} -> {sum(n > 1 for n in spelled_a)}"
    )
    for n in names:
        if before["options"][n] > 1 or after["options"][n] > 1:
            print(f"- {n}: {before['options'][n]} -> {after['options'][n]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
