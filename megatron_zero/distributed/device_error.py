"""DeviceError: the device asked for is not present, or cannot do what the flags ask (one sentence). Apart from
device.py, which loads torch, so that what the flags' checks import (fp8/settings.py) raises it without torch."""


class DeviceError(RuntimeError):
    """The device asked for is not present (one sentence)."""
