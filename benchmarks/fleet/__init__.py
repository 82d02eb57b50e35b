"""A fleet simulation: the real control plane with many peers (issue #47); see cli.py."""
