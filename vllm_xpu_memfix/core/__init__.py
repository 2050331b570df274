"""The plugin's own mechanics: settings, patching, host-wide locks, logging, units, roles,
the width of a command's text.

Imports nothing else of the package and never torch or vLLM; every other part may use it.
"""
