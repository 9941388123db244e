"""The fast layer: optional accelerators that must give the reference layer's numbers.

The compiled token passes (:mod:`.native`, built from ``analyzers/csrc``), their buffers and the
dispatch that picks them or the reference ops (:mod:`.kernels`). Imports the contract and reference layers.
"""
