"""Host-memory facts (snapshot, room), vLLM process trees, the phase ledger and its
attribution, estimates, and the host release of a loaded model.

Imports only ``core``; fixes, ``intel`` and the CLI use it.
"""
