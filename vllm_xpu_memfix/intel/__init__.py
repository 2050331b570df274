"""What the plugin knows of Intel's stack: sym_int4 layouts and device steps, the Q4_0
self-check, the GPU driver. Imports only ``core``, ``kernels`` and ``memory``; fixes and
the CLI use it. Changes when Intel ships an image.
"""
