"""olmo_tools: commands that need more than one package.

Public API (import from the modules; this package imports nothing heavy itself, so that a
light command such as olmo-compare-runs does not pay for torch, JAX and transformers):

- ``olmo_tools.convert.convert(src, dst, *, dtype=None, spec=None, overwrite=False)``
  and the ``olmo-convert`` command;
- ``olmo_tools.parity`` (``load_side``, ``compare``) and the ``olmo-parity logits`` command;
- ``olmo_tools.checkpoint`` (``Checkpoint``, ``parse_location``, ``CheckpointError``): the reader
  interface; ``olmo_tools.formats`` (``open_checkpoint``): the HF-layout / OLMo-core readers and
  writers and the reader of any kind; ``olmo_tools.native``: torch: and jax: dirs;
  ``olmo_tools.dcp``: torch.distributed.checkpoint directories.
"""

__version__ = "0.1.0"
