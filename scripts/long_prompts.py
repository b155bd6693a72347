"""Write a bench prompt file of long prompts (about 900-1,400 tokens for the default model)
from text every Debian machine has: two licenses in /usr/share/common-licenses and a
module of Python's own standard library, each cut to ``--words`` words and followed by a
request to summarize it. Nothing is downloaded and no corpus is committed.

    PYTHONPATH=src .venv/bin/python scripts/long_prompts.py --out /tmp/long.jsonl
    .venv/bin/speculative bench --prompts /tmp/long.jsonl --drafters ngram eagle auto \\
        --gamma 3 --max-new-tokens 128 --no-peers

The bench then measures speculation where a verification pass's attention reads a long
cache (README: "Catch-up window").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")
REQUEST = "Summarize the text above in a few sentences."


def sources() -> list[tuple[str, Path]]:
    """(category, file) of each text: the licenses, then a stdlib module's source."""
    return [
        ("long_license", LICENSES / "GPL-3"),
        ("long_license", LICENSES / "Apache-2.0"),
        ("long_code", Path(argparse.__file__)),  # the module this script parses with
    ]


def prompt_of(path: Path, words: int) -> str:
    text = " ".join(path.read_text(encoding="utf-8").split()[:words])
    return f"Here is a text:\n\n{text}\n\n{REQUEST}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--words", type=int, default=700, help="words kept of each text")
    args = parser.parse_args()
    missing = [str(path) for _, path in sources() if not path.is_file()]
    if missing:
        print(f"missing on this machine: {', '.join(missing)}", file=sys.stderr)
        return 2
    lines = [
        json.dumps({"category": category, "prompt": prompt_of(path, args.words)})
        for category, path in sources()
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
