"""Host-memory facts (snapshot), vLLM process trees, the phase ledger and its attribution."""
