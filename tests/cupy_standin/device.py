"""cupy.cuda's objects that the stand-in has: one device (id 0), its memory pointers, the null stream."""
from __future__ import annotations


class Device:
    """cupy.cuda.Device: the stand-in has one device, id 0; a context manager like CuPy's."""

    count = 1

    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)

    def __enter__(self):
        if not 0 <= self.id < self.count:
            raise RuntimeError(f"cudaErrorInvalidDevice: the stand-in has {self.count} device(s), not {self.id}")
        return self

    def __exit__(self, *exc):
        return False

    def use(self):
        self.__enter__()

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<CUDA Device {self.id} (stand-in)>"


class MemoryPointer:
    """What cupy.ndarray.data is: a device pointer (here the host address), never a buffer."""

    def __init__(self, a):
        self.ptr = a.__array_interface__["data"][0]
        self.device_id = 0

    def __repr__(self):
        return f"<MemoryPointer 0x{self.ptr:x} (stand-in)>"


class Stream:
    """The null stream: work on the stand-in is done when the call returns."""

    ptr = 0

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
