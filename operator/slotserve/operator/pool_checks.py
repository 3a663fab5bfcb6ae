"""Whether a pool that parsed may run here, checked before anything is written for it.

The schema and ``views.validate_pool`` judge the spec alone; this adds what depends on the rest
of the cluster: the operator's policy (images, host paths, service accounts), the model-name
rule (the oldest pool that claims a name wins), and what the CRD's rules cannot see (KEDA or
the Gateway API installed, another HorizontalPodAutoscaler, a Redis for the built-in
autoscaler). A refusal is an ``InvalidPoolError`` whose problem the pool's status shows.
"""

from __future__ import annotations

from typing import Any

import kopf

from slotserve.operator import kube
from slotserve.operator.gateway_api import GATEWAY_CRD
from slotserve.operator.keda import KEDA_CRD
from slotserve.operator.models import InferencePool
from slotserve.operator.policy import Policy, model_name_problem, model_name_winner
from slotserve.operator.status import Problem
from slotserve.operator.views import InvalidPoolError, Key, PoolView, all_views


async def check_pool(
    view: PoolView,
    *,
    policy: Policy,
    pool_index: kopf.Index[Key, Any],
    children: kube.Children,
    has_redis: bool,
) -> InferencePool:
    """The pool if it may run; raises InvalidPoolError (policy, name conflict) otherwise."""
    if view.pool is None:
        assert view.problem is not None
        raise InvalidPoolError(view.problem.reason, view.problem.message)
    problem = policy.check(view.pool)
    if problem is None and view.claim is not None:
        claims = [other.claim for other in all_views(pool_index)]
        winner = model_name_winner(view.claim, [c for c in claims if c is not None])
        if winner is not None:
            problem = model_name_problem(winner, view.claim.model)
    if problem is None:
        problem = await autoscaling_problem(view.pool, children, has_redis=has_redis)
    if (
        problem is None
        and view.pool.spec.gateway_api.inference_pool.enabled
        and not await children.crd_exists(GATEWAY_CRD)
    ):
        problem = Problem(
            "GatewayAPINotInstalled",
            f"gatewayAPI.inferencePool is enabled but the CRD {GATEWAY_CRD} is not installed",
        )
    if problem is not None:
        raise InvalidPoolError(problem.reason, problem.message)
    return view.pool


async def autoscaling_problem(
    pool: InferencePool, children: kube.Children, *, has_redis: bool
) -> Problem | None:
    """What the CRD's rules cannot see: KEDA missing, another HPA, no Redis to read."""
    autoscaling = pool.spec.autoscaling
    if autoscaling is None:
        return None
    if autoscaling.provider == "keda":
        if not await children.crd_exists(KEDA_CRD):
            return Problem(
                "KedaNotInstalled",
                f"autoscaling.provider is keda but the CRD {KEDA_CRD} is not installed",
            )
        return None
    if not has_redis:
        return Problem(
            "AutoscalingUnavailable",
            "the built-in autoscaler reads the gateways' Redis: the operator has no redis_url",
        )
    others = await children.autoscalers_of_pool(pool.metadata.namespace, pool.metadata.name)
    if others:
        return Problem(
            "AutoscalerConflict",
            f"HorizontalPodAutoscaler {', '.join(sorted(others))} also scales this pool: "
            "remove it, or remove spec.autoscaling (use provider keda for KEDA)",
        )
    return None
