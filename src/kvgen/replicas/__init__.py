"""kvgen's engine as replicas of a Ray Serve deployment, routed by prefix cache (docs/scaling.md).

Ray is an optional extra (pip install 'kvgen[ray]'): the modules that import it (router, relay,
board, deployment, launch) are imported only when replicas are asked for; the rest (prompt keys,
the affinity choice, options, the ASGI call) run without it.
"""
