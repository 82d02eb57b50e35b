"""vllm-ascend's own functions, taken from its released sdists, to run on CPU in the contract tier.

vllm-ascend imports torch-npu and CANN at module level, so its modules cannot be imported here.
Its functions that need neither are pure Python over torch: each is cut out of the released
source by name (:mod:`ast`), compiled on its own and run with the few globals it reads given
explicitly (``torch`` is the CPU one). Nothing of it is copied into this repository: the sdists
are fetched from PyPI once and kept in ``~/.cache/vllm-ascend-mooncake/`` (or
``$VAM_VLLM_ASCEND_CACHE``).
"""

from __future__ import annotations

import ast
import json
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

#: The vllm-ascend releases this package supports, on PyPI as sdists only.
RELEASES = ("0.23.0.post1", "0.30.0rc2")
#: The source files the contract tier reads, relative to the sdist's top directory.
FILES = (
    "vllm_ascend/worker/model_runner_v1.py",
    "vllm_ascend/attention/attention_v1.py",
    "vllm_ascend/utils.py",
    "vllm_ascend/distributed/kv_transfer/utils/utils.py",
)
PYPI_SIMPLE = "https://pypi.org/simple/vllm-ascend/"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "vllm-ascend-mooncake" / "vllm-ascend"
    return Path(os.environ.get("VAM_VLLM_ASCEND_CACHE", default))


def source_dir(release: str) -> Path:
    """The sdist's files the tier reads, fetched once; skips (never fails) without PyPI."""
    top = cache_dir() / f"vllm_ascend-{release}"
    if all((top / name).is_file() for name in FILES):
        return top
    try:
        url = _sdist_url(release)
        archive = cache_dir() / f"vllm_ascend-{release}.tar.gz"
        archive.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=120) as response:
            archive.write_bytes(response.read())
    except (urllib.error.URLError, OSError) as exc:
        pytest.skip(f"vllm-ascend {release}'s sdist cannot be fetched from PyPI: {exc}")
    with tarfile.open(archive) as tar:
        for name in FILES:
            member = tar.getmember(f"vllm_ascend-{release}/{name}")
            tar.extract(member, cache_dir(), filter="data")
    archive.unlink()
    return top


def _sdist_url(release: str) -> str:
    request = urllib.request.Request(
        PYPI_SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    wanted = f"vllm_ascend-{release}.tar.gz"
    for entry in files:
        if entry["filename"] == wanted:
            return entry["url"]
    raise AssertionError(f"PyPI lists no {wanted}")


def function(release: str, path: str, name: str, **globals_: Any) -> Any:
    """vllm-ascend ``release``'s function ``name`` from ``path`` (``Class.method`` for a method;
    a staticmethod comes back as its plain function), compiled with ``globals_``."""
    tree = ast.parse((source_dir(release) / path).read_text())
    owner, _, member = name.rpartition(".")
    body = tree.body
    if owner:
        (cls,) = [n for n in body if isinstance(n, ast.ClassDef) and n.name == owner]
        body = cls.body
    found = [n for n in body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == member]
    assert len(found) == 1, f"vllm-ascend {release} {path}: {len(found)} definitions of {name}"
    node = found[0]
    node.decorator_list = [
        d for d in node.decorator_list if not (isinstance(d, ast.Name) and d.id == "staticmethod")
    ]
    module = ast.Module(body=[node], type_ignores=[])
    # named after this module, which is in sys.modules (dataclasses resolve annotations there)
    namespace: dict[str, Any] = {"__name__": __name__, **globals_}
    exec(compile(module, f"vllm_ascend-{release}/{path}", "exec"), namespace)
    return namespace[member]
