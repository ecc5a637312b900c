"""The pure scheduling core: which tenant's request goes next, and what it is charged.

Nothing in this package does I/O, uses asyncio or reads a clock: time is passed in. The picker
service, the simulator and the tests drive the same functions, so what the experiments prove about
fairness is what production runs.
"""

from picker.core.cost import ComputedTokenCost, ContextAwareCost, CostFunction, LinearCost
from picker.core.lanes import LaneSpec, Scheduler
from picker.core.policy import POLICIES, FairnessPolicy, make_policy
from picker.core.request import Request, Usage

__all__ = [
    "POLICIES",
    "ComputedTokenCost",
    "ContextAwareCost",
    "CostFunction",
    "FairnessPolicy",
    "LaneSpec",
    "LinearCost",
    "Request",
    "Scheduler",
    "Usage",
    "make_policy",
]
