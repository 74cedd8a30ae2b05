"""The hybrid CPU+GPU inference engine (PyTorch). ``from workbench.engine import Engine``."""


def __getattr__(name: str):
    if name in ("Engine", "AcceleratorMemoryError", "HostMemoryError", "LoadCancelled"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)
