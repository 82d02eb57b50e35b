"""options.py: a key declared as a dataclass field is collected with its name, type and unit,
a part's keys where the part is, and filled back into the fields in the fields' units."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_ascend_mooncake.options import (
    KIB,
    POSITIVE,
    by_protocol,
    declared_options,
    default_of,
    option,
    option_fields,
    part,
    same_option,
)


@dataclass(frozen=True)
class Inner:
    wait_s: float = option(2.0, summary="a wait.", unit="s", bound=POSITIVE)
    chunk_bytes: int = option(
        0,
        key="chunk_kib",
        scale=KIB,
        computed=by_protocol(lambda protocol: 4 if protocol == "tcp" else 0),
        summary="a size.",
        unit="KiB",
    )
    not_a_key: int = 3


@dataclass(frozen=True)
class Passing:
    wait_s: float = same_option(Inner, "wait_s")


@dataclass(frozen=True, kw_only=True)
class Outer:
    first: str = option("a", summary="the first key.")
    inner: Inner = part()
    last: bool = option(False, key_type=bool, summary="the last key.")


def test_keys_are_collected_in_field_order_with_the_parts_where_they_are() -> None:
    keys = declared_options(Outer)
    assert [(k.name, k.type, k.field) for k in keys] == [
        ("first", str, "first"),
        ("wait_s", float, "wait_s"),
        ("chunk_kib", int, "chunk_bytes"),
        ("last", bool, "last"),
    ]
    assert [k.name for k in declared_options(Outer, parts=False)] == ["first", "last"]
    assert keys[2].default.markdown == "`4` with `tcp`, else `0`"
    assert default_of(Outer, "wait_s") == 2.0


def test_values_are_filled_in_the_fields_units() -> None:
    values = {"first": "b", "wait_s": 1.5, "chunk_kib": 3, "last": True}
    inner = Inner(**option_fields(Inner, values))
    assert inner == Inner(wait_s=1.5, chunk_bytes=3 * KIB)
    assert option_fields(Outer, values) == {"first": "b", "last": True}


def test_a_key_passed_on_is_the_same_key() -> None:
    (passed,) = declared_options(Passing)
    assert passed.name == "wait_s" and passed.summary == "a wait." and Passing().wait_s == 2.0


def test_a_key_needs_a_default_and_names_its_parts() -> None:
    with pytest.raises(TypeError):
        option(summary="no default.")
    with pytest.raises(TypeError):
        option(1, "a summary given by position.")  # type: ignore[misc]
