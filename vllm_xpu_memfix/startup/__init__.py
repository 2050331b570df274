"""The model of a vLLM start-up on Intel GPUs: what each phase needs on the host and on the
device, the causes, the verdict with how sure it is, and the remedies judged by re-running it.

Pure arithmetic on figures the caller read (``sizing`` turns a checkpoint, the engine
arguments and a machine into the model's inputs). The fixes take their figures from here
(the KV reserve, the staging per rank, the load slots), and doctor and the preflight judge
with it; nothing below ``fixes`` restates a rule of it.
"""
