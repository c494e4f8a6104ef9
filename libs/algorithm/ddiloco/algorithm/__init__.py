"""ddiloco.algorithm: the Decoupled DiLoCo algorithm as pure code, shared by the synchronizer
service and the fleet simulator.

``policies`` (quorum, adaptive grace, token weights: pure functions of now, state and policy),
``merge`` (token-weighted radial-directional averaging) and ``outer_optimizer`` (Nesterov SGD on
a flat fp32 fragment). Nothing here does I/O or reads a clock.
"""
