"""The continuous-batching scheduler under the import path README's Python API names
(``from runtime.scheduler import Params, Scheduler``); it lives in ``runtime.decoding``."""
from runtime.decoding.params import Params
from runtime.decoding.scheduler import Request, Scheduler

__all__ = ["Params", "Request", "Scheduler"]
