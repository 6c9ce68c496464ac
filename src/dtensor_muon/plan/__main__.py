"""``python -m dtensor_muon.plan``: the plan simulator (see :mod:`dtensor_muon.plan.simulate`)."""

from .simulate import main

main()
