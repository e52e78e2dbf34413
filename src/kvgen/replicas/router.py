"""PrefixAwareRouter: kvgen's request router for Ray Serve's RequestRouter API (imports Ray).

Ray Serve builds one in every process that holds a handle to the engine deployment (the ingress)
and asks it, per request, for a ranking of replicas; the choice itself is replicas/affinity.py.
Replicas report their prefix index's block keys through `record_routing_stats` (every stats
period, as `routing_stats`); queue lengths are Ray's own (its cache of each replica's ongoing
requests, probed when missing).
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvgen.replicas.affinity import AffinityTable, rank_replicas

log = logging.getLogger(__name__)


def request_keys(pending_request: Optional[PendingRequest]) -> tuple[int, ...]:
    """The block keys the ingress put on the call (replicas/asgi_call.RoutedCall)."""
    for arg in pending_request.args if pending_request is not None else ():
        keys = getattr(arg, "block_keys", None)
        if keys is not None:
            return tuple(keys)
    return ()


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 8, routed_ttl_s: float = 60.0, **_: Any) -> None:
        self.imbalance = imbalance
        self.table = AffinityTable(routed_ttl_s)
        self.decisions = {"prefix": 0, "load": 0, "spread": 0}

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:  # fmt: skip
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        for name, replica in by_id.items():
            stats = replica.routing_stats or {}
            if "keys" in stats:
                self.table.report(name, stats["keys"], stats.get("version", 0))
        queue_lens = await self._queue_lens(candidate_replicas)
        ranking, why = rank_replicas(request_keys(pending_request), queue_lens, self.table, self.imbalance)
        self.decisions[why] += 1
        return [[by_id[name] for name in tier] for tier in ranking]

    async def _queue_lens(self, replicas: List[RunningReplica]) -> dict[str, int]:
        """Each replica's ongoing requests: Ray's cached count, or a probe; a replica that answers
        no probe is left out of this choice."""
        lens: dict[str, int] = {}
        missing = []
        for replica in replicas:
            cached = self._replica_queue_len_cache.get(replica.replica_id)
            if cached is None:
                missing.append(replica)
            else:
                lens[replica.replica_id.to_full_id_str()] = cached
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                if queue_len is not None:
                    lens[replica.replica_id.to_full_id_str()] = queue_len
        return lens

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys = request_keys(pending_request)
        if keys:
            self.table.routed(replica_id.to_full_id_str(), keys)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.remove(replica_id.to_full_id_str())

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.table.keep_only([r.replica_id.to_full_id_str() for r in replicas])
