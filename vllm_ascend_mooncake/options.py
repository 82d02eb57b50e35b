"""Keys of ``kv_connector_extra_config``, declared where they are read.

A part that reads a key declares it as a field of its options dataclass, with :func:`option`:
its type (the field's), default, unit, bound, meaning and the other connectors' spellings of it
(``ReceiverOptions.read_retries``, ``MooncakeOptions.protocol``, ...). The connector's
configuration composes those dataclasses (:func:`part`), and everything else is derived from the
declarations (:func:`declared_options`): what :func:`.connector.config.parse_config` accepts and
refuses, the key table of ``docs/configuration.md`` (:func:`key_table_markdown`) and the keys of
other connectors that :mod:`.connector.migration` reads. Adding a key is one field where it is
read, plus ``python scripts/config_table.py --write``.

Below every layer (``core`` declares keys too), so it imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

#: Bytes per unit of the ``*_kib`` / ``*_mib`` keys.
KIB = 1 << 10
MIB = 1 << 20


class ConnectorConfigError(ValueError):
    """The connector configuration is invalid for this engine."""


@dataclass(frozen=True)
class Bound:
    """The values a key accepts beyond its type."""

    #: what a refusal says the value must be (``... must be > 0, got 0``), and the docs show
    text: str
    ok: Callable[[Any], bool]
    #: how the docs show it, if not as ``text``
    markdown: str = ""
    #: the refusal, if not ``{where} must be {text}, got {value!r}`` (a format string)
    refusal: str = ""

    def refuse(self, where: str, value: Any) -> ConnectorConfigError:
        if self.refusal:
            return ConnectorConfigError(self.refusal.format(where=where, value=value))
        return ConnectorConfigError(f"{where} must be {self.text}, got {value!r}")


POSITIVE = Bound("> 0", lambda value: value > 0)
NON_NEGATIVE = Bound(">= 0", lambda value: value >= 0)
PORT = Bound("a port number, 1 to 65535", lambda value: 1 <= value <= 65535, "1 to 65535")
#: a negative size meant "the default" before the keys were declared; it still does
NEGATIVE = Bound("< 0", lambda value: value < 0)


def one_of(values: Iterable[str], refusal: str = "") -> Bound:
    """One of ``values`` (refused as ``refusal`` says, if given)."""
    values = tuple(values)
    return Bound(
        f"one of {', '.join(values)}",
        lambda value: value in values,
        ", ".join(f"`{value}`" for value in values),
        refusal,
    )


@dataclass(frozen=True)
class Computed:
    """A default that is not one value: computed when the configuration is parsed."""

    #: how the docs show it
    markdown: str
    #: the default as a function of the protocol; None: :func:`~.connector.config.parse_config`
    #: computes it
    of_protocol: Callable[[str], Any] | None = None


def literal(value: Any) -> str:
    """A value as the docs write it: ``120`` for 120.0, ``true``, ``""``."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:g}"
    elif value == "":
        text = '""'
    else:
        text = str(value)
    return f"`{text}`"


def by_protocol(of_protocol: Callable[[str], Any]) -> Computed:
    """A default that is one value over tcp and another on every other transport."""
    return Computed(
        f"{literal(of_protocol('tcp'))} with `tcp`, else {literal(of_protocol('rdma'))}",
        of_protocol,
    )


@dataclass(frozen=True)
class Alias:
    """A key of another connector that means the same as one of ours: read under our name with
    a warning naming the key to write instead (docs/migration.md)."""

    name: str
    origin: str
    #: the value under our key, from the alias's value; raises naming ``where`` if unusable
    convert: Callable[[str, Any], Any]
    note: str = ""


@dataclass(frozen=True)
class Option:
    """One key of ``kv_connector_extra_config``: how it is checked, and how the docs show it.
    Everything after the default is named where declared (no field can be taken for another)."""

    name: str
    type: type
    #: the value when the key is not set (in the key's unit): a plain value, or :class:`Computed`
    default: Any
    _: KW_ONLY
    #: one line: what the key sets (the first sentence of its row in the docs)
    summary: str
    #: the rest of its row in the docs
    details: str = ""
    unit: str = ""
    #: checked on every given value by :func:`~.connector.config.parse_config` (with the type)
    bound: Bound | None = None
    #: given values that mean "the default" (kept: earlier versions accepted them)
    as_default: Bound | None = None
    #: checked, type included, by the key's own code in :func:`~.connector.config.parse_config`;
    #: the docs show ``allowed`` then
    own_check: bool = False
    #: the docs' type column, if not the type's name
    type_markdown: str = ""
    #: the docs' allowed column, if not the bound's
    allowed: str = ""
    #: keys of other connectors read as this one
    aliases: tuple[Alias, ...] = ()
    #: the dataclass field that holds the value ("": the key's name) ...
    field: str = ""
    #: ... in units of this many of the key's (``1024`` for a ``*_kib`` key held in bytes)
    scale: int = 1

    def allowed_markdown(self) -> str:
        text = self.allowed or (
            (self.bound.markdown or self.bound.text) if self.bound is not None else "any"
        )
        if self.as_default is not None:
            text += f" ({self.as_default.markdown or self.as_default.text}: the default)"
        return text

    def default_markdown(self) -> str:
        if isinstance(self.default, Computed):
            return self.default.markdown
        return literal(self.default)

    def row(self) -> str:
        meaning = f"{self.summary} {self.details}" if self.details else self.summary
        cells = (
            f"`{self.name}`",
            self.type_markdown or self.type.__name__,
            self.unit,
            self.default_markdown(),
            self.allowed_markdown(),
            meaning,
        )
        return "| " + " | ".join(cells) + " |"


#: The metadata keys of the fields :func:`option` and :func:`part` make.
_OPTION = "vam_option"
_PART = "vam_options_part"


def option(
    default: Any = dataclasses.MISSING,
    *,
    summary: str,
    computed: Computed | None = None,
    key: str = "",
    key_type: type | None = None,
    scale: int = 1,
    repr: bool = True,
    **declaration: Any,
) -> Any:
    """A dataclass field that a key of ``kv_connector_extra_config`` sets.

    ``default``: the field's default (in its own unit); ``computed``: the key's default when it
    is not one value (the field then has no default, or ``default`` where it is used without a
    configuration). ``key``: the key's name, if not the field's; ``key_type``: its type, if not
    the field's; ``scale``: field units per key unit; ``repr``: as :func:`dataclasses.field`'s.
    ``declaration``: the rest of :class:`Option` (``details``, ``unit``, ``bound``,
    ``aliases``, ...)."""
    if computed is not None:
        key_default = computed
    elif default is dataclasses.MISSING:
        raise TypeError(f"option {key or summary!r} needs a default or a computed one")
    else:
        key_default = default if scale == 1 else default // scale
    declared = Option(
        key,
        key_type,
        key_default,
        summary=summary,
        scale=scale,
        **declaration,  # type: ignore[arg-type]
    )
    return dataclasses.field(default=default, repr=repr, metadata={_OPTION: declared})


def same_option(owner: type, name: str) -> Any:
    """The field ``owner.name`` declares, declared again in another dataclass that passes the
    value on to ``owner`` (the same key, once in the docs)."""
    original = owner.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return dataclasses.field(default=original.default, metadata=original.metadata)


def part() -> Any:
    """A field whose dataclass declares keys of its own: a configuration composed of parts
    accepts, documents and fills in those keys as its own."""
    return dataclasses.field(metadata={_PART: True})


def declared_options(cls: type, *, parts: bool = True) -> tuple[Option, ...]:
    """The keys the dataclass ``cls`` declares, in field order, its parts' keys where the part
    is (unless ``parts`` is false), each with its name, type and field filled in."""
    hints = typing.get_type_hints(cls)
    found: list[Option] = []
    for field in dataclasses.fields(cls):
        if field.metadata.get(_PART):
            if parts:
                found.extend(declared_options(hints[field.name]))
        elif (declared := field.metadata.get(_OPTION)) is not None:
            found.append(
                dataclasses.replace(
                    declared,
                    name=declared.name or field.name,
                    type=declared.type or hints[field.name],
                    field=field.name,
                )
            )
    return tuple(found)


def option_fields(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``cls`` (its parts left out) that ``values`` (key -> value in the key's
    unit) sets, in the fields' units: keyword arguments for ``cls``."""
    return {
        declared.field: values[declared.name] * declared.scale
        if declared.scale != 1
        else values[declared.name]
        for declared in declared_options(cls, parts=False)
        if declared.name in values
    }


def default_of(cls: type, name: str) -> Any:
    """The default of the key ``name`` that ``cls`` (or one of its parts) declares."""
    return next(declared.default for declared in declared_options(cls) if declared.name == name)


#: The markers around the generated key table in docs/configuration.md.
KEY_TABLE_BEGIN = "<!-- keys:begin: generated, run python scripts/config_table.py --write -->"
KEY_TABLE_END = "<!-- keys:end -->"


def key_table_markdown(options: Iterable[Option]) -> str:
    """The key table of docs/configuration.md, one row per key."""
    header = ("key", "type", "unit", "default", "allowed", "meaning")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *(declared.row() for declared in options),
    ]
    return "\n".join(lines) + "\n"


def with_key_table(markdown: str, table: str) -> str:
    """``markdown`` (docs/configuration.md) with ``table`` between the markers."""
    before, begin, rest = markdown.partition(KEY_TABLE_BEGIN)
    _, end, after = rest.partition(KEY_TABLE_END)
    if not begin or not end:
        raise ValueError(f"no {KEY_TABLE_BEGIN!r} ... {KEY_TABLE_END!r} in the markdown")
    return f"{before}{KEY_TABLE_BEGIN}\n{table}{KEY_TABLE_END}{after}"
