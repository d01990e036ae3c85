"""The code blocks of a Markdown file, as a reader copies them: what `.ci/run` runs of README.md
and what `tests/test_docs.py` runs of README.md and docs/training.md.

A fenced block whose info string is ``bash``, ``sh`` or ``python`` is runnable. An HTML comment
``<!-- ci: skip: REASON -->`` on the line before a block says why a test must not run it (it
needs GPUs, or it is the install/test command that `.ci/run` runs itself); the reason is
required. Standard library only: `.ci/run` reads README.md with it before anything is installed.

    python3 tools/doc_blocks.py README.md --section "Set up" --index 0   # print one block's code
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from typing import List, Optional

RUNNABLE = ("bash", "sh", "python")
_SKIP = re.compile(r"^<!--\s*ci:\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^```(?P<info>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    lang: str             # the fence's info string ('' for plain text)
    code: str
    line: int             # 1-based line of the opening fence
    section: str          # the nearest '#'-heading above, without the '#'s
    skip: Optional[str]   # the reason of a preceding '<!-- ci: skip: ... -->', else None

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE


def blocks(path: str) -> List[Block]:
    """Every fenced block of ``path`` in order. A skip marker without a reason, or an unclosed
    fence, is a ValueError naming the file and line."""
    lines = open(path, encoding="utf-8").read().splitlines()
    out: List[Block] = []
    section, i = "", 0
    while i < len(lines):
        text = lines[i]
        if text.startswith("#"):
            section = text.lstrip("#").strip()
        fence = _FENCE.match(text)
        if not fence:
            if text.strip().startswith("<!-- ci:") and not _SKIP.match(text.strip()):
                raise ValueError(f"{path}:{i + 1}: write '<!-- ci: skip: REASON -->'")
            i += 1
            continue
        start, i = i, i + 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: code block is not closed")
        prev = lines[start - 1].strip() if start else ""
        marker = _SKIP.match(prev)
        if marker and not marker.group("reason"):
            raise ValueError(f"{path}:{start}: a ci skip marker needs a reason")
        out.append(Block(fence.group("info"), "\n".join(lines[start + 1:i]) + "\n", start + 1,
                         section, marker.group("reason") if marker else None))
        i += 1
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--section", required=True, help="the heading the block sits under")
    p.add_argument("--index", type=int, required=True, help="0-based, among that section's "
                                                            "runnable blocks")
    args = p.parse_args(argv)
    found = [b for b in blocks(args.path) if b.runnable and b.section == args.section]
    if not 0 <= args.index < len(found):
        p.error(f"{args.path}: section {args.section!r} has {len(found)} runnable block(s); "
                f"--index {args.index} is out of range")
    sys.stdout.write(found[args.index].code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
