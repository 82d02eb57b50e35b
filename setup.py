"""Thin shim so that legacy tooling (`python setup.py develop`, old pips) works.

The project is configured in pyproject.toml.
"""

from setuptools import setup

setup()
