"""Live measurements of this machine without torch or Qt: NVML (``nvml``), host (``host``), and the
background ``sampler`` that keeps ring buffers of both for the GUI."""
