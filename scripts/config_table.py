"""The key table of docs/configuration.md, generated from ``KEYS`` in
``vllm_ascend_mooncake/connector/config.py`` (the keys as declared where they are read).

    python scripts/config_table.py           # print the table
    python scripts/config_table.py --write   # rewrite it between the markers in the docs
    python scripts/config_table.py --check   # exit 1 if the docs' table is not the generated one
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "configuration.md"
sys.path.insert(0, str(REPO))

from vllm_ascend_mooncake.connector.config import (  # noqa: E402
    key_table,
    with_generated_key_table,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"rewrite the table in {DOCS}")
    action.add_argument("--check", action="store_true", help=f"check the table in {DOCS}")
    args = parser.parse_args()
    if not (args.write or args.check):
        sys.stdout.write(key_table())
        return 0
    current = DOCS.read_text()
    generated = with_generated_key_table(current)
    if args.check:
        if generated != current:
            print(f"{DOCS} is out of date: run python scripts/config_table.py --write")
            return 1
        return 0
    if generated != current:
        DOCS.write_text(generated)
        print(f"rewrote the key table of {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
