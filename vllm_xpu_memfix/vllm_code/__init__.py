"""What the plugin reads of vLLM's own code: platform-worker overrides, warm-up sections.

Imports only ``core``; fixes and the CLI use it. Changes when vLLM ships a release.
"""
