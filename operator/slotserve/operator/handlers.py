"""kopf handlers: one level-based convergence per pool, run on pool events and on child drift.

- ``reconcile`` runs on create, update and resume: validate, check the pool may run here
  (``pool_checks``: the operator's policy, the model-name rule), build the children with the pure
  builders, adopt them (owner references) and create-or-patch them. A pool that cannot run
  becomes Degraded with a reason and a Warning event, and nothing is written for it; conflicts
  and transient API errors are retried by kopf (``TemporaryError``, growing delays).
- Children (Deployment, Service, NetworkPolicy) are watched: one deleted or changed by hand
  (image, args, replicas, a widened pod spec) puts its pool on the ``Healer`` queue, which
  converges it again within a second and retries failures with backoff; the queue also
  re-converges every pool every ``resync_seconds``.
- Pods and Deployments feed kopf indexes; every change recomputes the pool's status.
- Deleting a pool deletes its children through their owner references (no finalizer).

Every handler is a coroutine on kopf's event loop (kopf would run plain functions in a thread
pool); the API calls are asyncio too (``kube_api``). What a handler decides is in the pure
modules: ``views`` (what is known of a pool), ``pool_checks``, ``builders``, ``status``; the
status write is ``status_writer``'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from slotserve.contracts.crd import GROUP, PLURAL, VERSION
from slotserve.operator import builders, drift, kube
from slotserve.operator.admission_monitor import AdmissionMonitor
from slotserve.operator.admission_redis import AdmissionReader
from slotserve.operator.autoscaling import Autoscaling
from slotserve.operator.gateway_api import build_gateway_inference_pool
from slotserve.operator.handler_context import HandlerContext
from slotserve.operator.healer import Healer
from slotserve.operator.keda import build_scaled_object
from slotserve.operator.kube_api import KubeApi, api_message
from slotserve.operator.models import InferencePool
from slotserve.operator.network import build_network_policy
from slotserve.operator.policy import Policy
from slotserve.operator.pool_checks import check_pool
from slotserve.operator.settings import OperatorSettings
from slotserve.operator.status import DeploymentView, PodView, Problem
from slotserve.operator.status_writer import StatusWriter
from slotserve.operator.views import InvalidPoolError, Key, PoolView, all_views, first

POOLS = (GROUP, VERSION, PLURAL)
# Fully qualified: a bare "pods" also matches metrics.k8s.io's PodMetrics.
DEPLOYMENTS = ("apps", "v1", "deployments")
PODS = ("v1", "pods")
SERVICES = ("v1", "services")
NETWORK_POLICIES = ("networking.k8s.io", "v1", "networkpolicies")
# Mapping[str, Any]: kopf's type for label filters (MetaFilter) is not public.
CHILD_LABELS: Mapping[str, Any] = {
    builders.POOL_LABEL: kopf.PRESENT,
    "app.kubernetes.io/managed-by": builders.MANAGED_BY,
}
INDEXES = ("pool_index", "pod_index", "deployment_index")
log = logging.getLogger(__name__)


def pool_key(namespace: str | None, name: str) -> Key:
    """The index key of a namespaced object (kopf types the namespace as optional)."""
    if namespace is None:
        raise ValueError(f"{name}: a namespaced object without a namespace")
    return (namespace, name)


def retry_delay(retry: int) -> float:
    """kopf's delay before retrying a handler that failed ``retry`` times: 1 s doubling to 60 s."""
    return float(min(60, 2**retry))


class PoolOperator:
    """The handlers of one operator process, registered on their own kopf registry."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        self.policy: Policy = settings.policy()
        self._api: KubeApi | None = None
        self._writer: StatusWriter | None = None
        # kopf passes the same index objects to every handler; the operator's own tasks (healer,
        # admission monitor) keep them (filled in place by the first handler), and a handler's
        # context, in which kopf.warn() can post events.
        self._indexes: dict[str, Any] = {}
        self._handler_context = HandlerContext()
        self.healer: Healer[Key] = Healer(
            self._heal, resync_seconds=settings.resync_seconds, keys=self._known_pools
        )
        self.admission_monitor: AdmissionMonitor | None = None

    @property
    def writer(self) -> StatusWriter:
        if self._writer is None:
            raise RuntimeError("the operator has not started (no API client yet)")
        return self._writer

    def build_registry(self) -> kopf.OperatorRegistry:
        """A registry with every handler of this operator (no module-level global state)."""
        registry = kopf.OperatorRegistry()
        # Explicit ids: kopf would name methods "PoolOperator.x"; index ids become kwarg names.
        kopf.on.login(registry=registry, id="login")(self.login)
        kopf.on.startup(registry=registry, id="startup")(self.startup)
        kopf.on.cleanup(registry=registry, id="cleanup")(self.cleanup)
        kopf.index(*POOLS, registry=registry, id="pool_index")(self.pool_index)
        kopf.index(*PODS, labels=CHILD_LABELS, registry=registry, id="pod_index")(self.pod_index)
        kopf.index(*DEPLOYMENTS, labels=CHILD_LABELS, registry=registry, id="deployment_index")(
            self.deployment_index
        )
        for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
            on(*POOLS, registry=registry, id="reconcile")(self.reconcile)
        kopf.on.event(*POOLS, registry=registry, id="pool_event")(self.pool_event)
        for resource in (PODS, DEPLOYMENTS, SERVICES, NETWORK_POLICIES):
            kopf.on.event(*resource, labels=CHILD_LABELS, registry=registry, id="child_event")(
                self.child_event
            )
        return registry

    # --- start-up and shut-down -------------------------------------------------------------

    async def login(self, **_: Any) -> kopf.ConnectionInfo:
        # A thread: loading a kubeconfig may run its exec credential plugin.
        return kube.connection_info(await asyncio.to_thread(kube.load_configuration))

    async def startup(self, **_: Any) -> None:
        configuration = await asyncio.to_thread(kube.load_configuration)
        self._api = KubeApi(configuration, user_agent=kube.USER_AGENT)
        self._writer = StatusWriter(kube.Children(self._api))
        self.healer.start()
        if self.settings.redis_url:
            password = self.settings.redis_password
            autoscaling = Autoscaling(
                indexes=self._indexes,
                writer=self._writer,
                refresh=self._refresh,
                handler_context=self._handler_context,
            )
            self.admission_monitor = AdmissionMonitor(
                AdmissionReader(
                    self.settings.redis_url,
                    prefix=self.settings.redis_prefix,
                    password=password.get_secret_value() if password else None,
                ),
                refresh_s=self.settings.admission_refresh_seconds,
                max_age_s=self.settings.admission_max_age_seconds,
                targets=autoscaling.targets,
                publish=autoscaling.publish,
                on_reading=autoscaling.autoscale,
            )
            self.admission_monitor.start()

    async def cleanup(self, **_: Any) -> None:
        await self.healer.stop()
        if self.admission_monitor is not None:
            await self.admission_monitor.stop()
        if self._api is not None:
            await self._api.close()

    # --- indexes: in-memory views fed by the watches ---------------------------------------

    async def pool_index(
        self, body: kopf.Body, namespace: str | None, name: str, **_: Any
    ) -> dict[Key, PoolView]:
        return {pool_key(namespace, name): PoolView.from_body(body)}

    async def pod_index(
        self, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
    ) -> dict[Key, PodView]:
        return {pool_key(namespace, labels[builders.POOL_LABEL]): PodView.from_body(body)}

    async def deployment_index(
        self, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
    ) -> dict[Key, DeploymentView]:
        return {pool_key(namespace, labels[builders.POOL_LABEL]): DeploymentView.from_body(body)}

    def _keep(self, indexes: Mapping[str, Any]) -> None:
        if not self._indexes:
            # In place: the autoscaling component holds this same dict.
            self._indexes.update({name: indexes[name] for name in INDEXES})
            self._handler_context.keep()

    def _known_pools(self) -> list[Key]:
        pool_index = self._indexes.get("pool_index")
        return list(pool_index) if pool_index is not None else []

    # --- convergence ------------------------------------------------------------------------

    def desired_children(self, pool: InferencePool, owner: kopf.Body) -> list[dict[str, Any]]:
        """The children of ``pool``, adopted by ``owner`` (its body)."""
        settings = self.settings
        children = [
            builders.build_deployment(
                pool, engine_image=settings.engine_image, hub_endpoint=settings.hub_endpoint
            ),
            builders.build_service(pool),
        ]
        if settings.network_policy:
            children.append(
                build_network_policy(
                    pool,
                    gateway_namespace=settings.gateway_namespace,
                    gateway_pod_labels=settings.gateway_pod_labels,
                    scraper_peers=settings.scraper_peers,
                    egress=settings.engine_egress_rules(),
                )
            )
        autoscaling = pool.spec.autoscaling
        if autoscaling is not None and autoscaling.provider == "keda":
            children.append(build_scaled_object(pool))
        if pool.spec.gateway_api.inference_pool.enabled:
            children.append(build_gateway_inference_pool(pool))
        kopf.adopt(children, owner=owner)
        return children

    async def _converge(self, key: Key, view: PoolView, generation: int | None) -> Problem | None:
        """Check and apply one pool; record the outcome in its status (and an event).

        Returns the problem that stopped it (None when the children are as built); raises
        ApiException for transient API errors, which the caller retries.
        """
        problem: Problem | None = None
        outcomes: dict[str, str] = {}
        try:
            pool = await check_pool(
                view,
                policy=self.policy,
                pool_index=self._indexes["pool_index"],
                children=self.writer.children,
                has_redis=bool(self.settings.redis_url),
            )
            children = self.desired_children(pool, view.owner)
            for child in children:
                outcomes[child["kind"]] = await self.writer.children.apply(
                    child, owner_uid=view.uid
                )
            removed = await self.writer.children.remove_unwanted(
                *view.key,
                owner_uid=view.uid,
                wanted={(child["apiVersion"], child["kind"]) for child in children},
            )
            outcomes.update(dict.fromkeys(removed, "deleted"))
        except InvalidPoolError as error:
            problem = error.problem
        except kube.ChildConflictError as error:
            problem = Problem("ChildConflict", str(error))
        except ApiException as error:
            if error.status not in {400, 422}:
                raise
            problem = Problem("ChildRejected", api_message(error))  # what we built was refused
        previous = self.writer.problems.get(key)
        if problem is None:
            self.writer.problems.pop(key, None)
            if any(outcome != "unchanged" for outcome in outcomes.values()):
                log.info("pool %s/%s: %s", *key, outcomes)
        else:
            self.writer.problems[key] = problem
            if problem != previous:  # one event per new problem, not one per resync
                kopf.warn(view.owner, reason=problem.reason, message=problem.message)
        await self._refresh(key, observed_generation=generation)
        return problem

    async def reconcile(
        self, body: kopf.Body, namespace: str | None, name: str, retry: int, **indexes: Any
    ) -> None:
        self._keep(indexes)
        key = pool_key(namespace, name)
        generation = int(body["metadata"].get("generation", 1))
        try:
            problem = await self._converge(key, PoolView.from_body(body), generation)
        except ApiException as error:
            if error.status in {409, 429} or error.status >= 500:
                raise kopf.TemporaryError(
                    f"API said {error.status}; retrying", delay=retry_delay(retry)
                ) from error
            raise
        if problem is not None and problem.reason == "ChildConflict":
            raise kopf.TemporaryError(problem.message, delay=30)
        if problem is not None:
            raise kopf.PermanentError(problem.message)

    async def _heal(self, key: Key) -> bool:
        """The healer's work: converge ``key`` again; False = retry later (with backoff)."""
        if not self._handler_context.can_post_events:  # no handler has run yet: nothing is known
            return True
        return await self._handler_context.run(self._heal_in_context(key))

    async def _heal_in_context(self, key: Key) -> bool:
        view: PoolView | None = first(self._indexes["pool_index"], key)
        if view is None:
            return True
        if not await self.writer.children.pool_exists(*view.key, view.uid):
            return True  # being deleted: the garbage collector removes its children
        try:
            problem = await self._converge(key, view, None)
        except ApiException as error:
            if error.status in {409, 429} or error.status >= 500:
                return False
            raise
        return problem is None or problem.reason != "ChildConflict"

    # --- watching pools and children ----------------------------------------------------------

    async def pool_event(
        self, type: str | None, body: kopf.Body, namespace: str | None, name: str, **indexes: Any
    ) -> None:
        """A pool changed or went: pools that share (or shared) its model name are re-checked."""
        self._keep(indexes)
        key = pool_key(namespace, name)
        if type == "DELETED":
            self.writer.forget(key)
        model = ((body.get("spec") or {}).get("model") or {}).get("name")
        for view in all_views(indexes["pool_index"]):
            other = view.key
            conflicted = self.writer.problems.get(other, Problem("", "")).reason
            if other != key and (
                (view.claim is not None and view.claim.model == model)
                or conflicted == "ModelNameConflict"
            ):
                self.healer.enqueue(other)

    async def child_event(
        self,
        type: str | None,
        body: kopf.Body,
        namespace: str | None,
        labels: kopf.Labels,
        **indexes: Any,
    ) -> None:
        self._keep(indexes)
        key = pool_key(namespace, labels[builders.POOL_LABEL])
        view: PoolView | None = first(indexes["pool_index"], key)
        if view is None:
            return
        is_pod = body.get("kind") == "Pod"
        if (
            not is_pod
            and view.pool is not None
            and (type == "DELETED" or not self._child_in_sync(view, view.pool, body))
        ):
            self.healer.enqueue(key)
        await self._refresh(key)

    def _child_in_sync(self, view: PoolView, pool: InferencePool, body: kopf.Body) -> bool:
        live = dict(body)
        wanted = [
            child
            for child in self.desired_children(pool, view.owner)
            if child["kind"] == live.get("kind")
        ]
        return all(drift.in_sync(child, live) for child in wanted)

    async def _refresh(self, key: Key, observed_generation: int | None = None) -> None:
        await self.writer.refresh(
            key,
            pool_index=self._indexes["pool_index"],
            pod_index=self._indexes["pod_index"],
            deployment_index=self._indexes["deployment_index"],
            observed_generation=observed_generation,
        )
