"""docs/configuration.md documents exactly the keys config.py accepts, with the code's defaults.

Its key table is generated from ``config.KEYS`` (``python scripts/config_table.py --write``);
these tests fail when the two differ, and check the declared defaults against parse_config."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import pytest

from vllm_ascend_mooncake.connector.config import KEYS_BY_NAME, parse_config
from vllm_ascend_mooncake.connector.config import key_table as key_table_markdown
from vllm_ascend_mooncake.datapath.mooncake import default_protocol
from vllm_ascend_mooncake.options import KEY_TABLE_BEGIN, KEY_TABLE_END

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def docs_key_table() -> tuple[list[str], dict[str, list[str]]]:
    """The table whose first column is ``key``: its header, and key -> the row's cells."""
    lines = DOCS.read_text().splitlines()
    starts = [
        i
        for i, line in enumerate(lines)
        if line.lstrip().startswith("|") and _cells(line)[0] == "key"
    ]
    assert len(starts) == 1, f"{DOCS} has {len(starts)} tables whose first column is 'key', not 1"
    start = starts[0]
    header = _cells(lines[start])
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2 :]:  # past the header and its |---| line
        if not line.lstrip().startswith("|"):
            break
        cells = _cells(line)
        assert len(cells) == len(header), f"{DOCS}: row with {len(cells)} cells: {line}"
        key = cells[0].strip("`")
        assert key not in rows, f"{DOCS}: key {key!r} has two rows"
        rows[key] = cells
    return header, rows


def test_the_docs_table_is_the_generated_one() -> None:
    """A key added, removed or changed in config.KEYS without regenerating the docs fails here."""
    text = DOCS.read_text()
    assert text.count(KEY_TABLE_BEGIN) == 1 and text.count(KEY_TABLE_END) == 1, (
        f"{DOCS} must have the key table between one {KEY_TABLE_BEGIN!r} and one {KEY_TABLE_END!r}"
    )
    documented = text.split(KEY_TABLE_BEGIN)[1].split(KEY_TABLE_END)[0].strip("\n")
    generated = key_table_markdown().strip("\n")
    diff = "\n".join(
        difflib.unified_diff(
            documented.splitlines(), generated.splitlines(), "docs", "config.KEYS", lineterm=""
        )
    )
    assert documented == generated, (
        f"the key table of {DOCS} is not the one config.KEYS generates: run "
        f"`python scripts/config_table.py --write`\n{diff}"
    )


@pytest.fixture(scope="module")
def table() -> tuple[list[str], dict[str, list[str]]]:
    return docs_key_table()


def test_the_docs_table_lists_exactly_the_accepted_keys(table) -> None:
    documented = set(table[1])
    accepted = set(KEYS_BY_NAME)
    assert documented == accepted, (
        f"docs/configuration.md and config.KEYS_BY_NAME disagree: keys without a docs row: "
        f"{sorted(accepted - documented)}; docs rows for keys config.py does not accept: "
        f"{sorted(documented - accepted)}"
    )


def _parsed(**extra: Any) -> Any:
    """The configuration a decode instance gets when it sets only ``extra``."""
    return parse_config(
        kv_role="kv_consumer",
        engine_id="e",
        extra={"side_channel_host": "127.0.0.1", **extra},
        local_tp=1,
        local_dp=1,
        num_kv_heads=4,
        is_mla=False,
        block_size=32,
        device_type="cpu",
    )


_NUMBER = r"-?\d+(?:\.\d+)?"
_LITERAL = rf'`({_NUMBER}|true|false|""|[a-z]+)`'


def _value(text: str) -> Any:
    if re.fullmatch(_NUMBER, text):
        return float(text) if "." in text else int(text)
    return {"true": True, "false": False, '""': ""}.get(text, text)


def _same(code: Any, docs: Any) -> bool:
    if isinstance(code, bool) or isinstance(docs, bool):  # True == 1, but `1` is no bool
        return type(code) is type(docs) and code == docs
    return code == docs  # `120` documents 120.0 too


def test_the_docs_defaults_are_the_codes(table) -> None:
    """Defaults the docs write as a literal (``10``, ``true``), as ``X with tcp, else Y`` or as
    ``X on CPU, Y on CUDA, ...`` must be what parse_config gives; others (prose) are skipped."""
    header, rows = table
    column = header.index("default")
    checked, wrong = [], []
    for key, cells in rows.items():
        if key not in KEYS_BY_NAME:
            continue  # the test above names it
        default = cells[column]
        if plain := re.fullmatch(_LITERAL, default):
            cases = [({}, _value(plain.group(1)))]
        elif by_tcp := re.fullmatch(rf"{_LITERAL} with `tcp`, else {_LITERAL}", default):
            cases = [
                ({"protocol": "tcp"}, _value(by_tcp.group(1))),
                ({"protocol": "rdma"}, _value(by_tcp.group(2))),
            ]
        elif by_device := re.findall(r"`([a-z]+)` on ([A-Za-z]+)", default):
            for protocol, device in by_device:
                checked.append(key)
                code = default_protocol(device.lower())
                if code != protocol:
                    wrong.append(f"{key} on {device}: docs {protocol!r}, code {code!r}")
            continue
        else:
            continue  # prose, not a checkable value
        for extra, documented in cases:
            code = getattr(_parsed(**extra), key)
            checked.append(key)
            if not _same(code, documented):
                where = f"{key} with {extra}" if extra else key
                wrong.append(f"{where}: docs {documented!r}, code {code!r}")
    assert not wrong, "docs/configuration.md shows defaults the code does not use: " + "; ".join(
        wrong
    )
    # A table whose default column stopped parsing would pass vacuously.
    assert len(set(checked)) >= 15, f"only {sorted(set(checked))} had checkable defaults"
