"""Front ends: one short class per matrix optimizer over :class:`.base.MatrixOptimizer`.

Importing this package makes each front end known to the plan simulator (``python -m dtensor_muon.plan
--optimizer NAME``) with its rule and its option defaults: :func:`dtensor_muon.plan.simulate.register_front_end`.
"""

from ..plan.simulate import register_front_end
from .mop import MOP
from .muon import Muon
from .normuon import NorMuon
from .options import OPTIONS
from .soap import KLSOAP, REKLS, SOAP


def _register_front_ends() -> None:
    for front_end in (Muon, NorMuon, MOP, SOAP, KLSOAP, REKLS):
        options = OPTIONS[front_end.__name__]
        defaults = {o.name: o.default for o in options if not o.engine}
        wire_bytes = next(o.default for o in options if o.name == "wire_dtype").itemsize
        register_front_end(front_end, defaults, wire_bytes)


_register_front_ends()
