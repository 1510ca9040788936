"""Prometheus metrics: the agent's own ``gpu_agent_*`` series (DCGM-named GPU series come from
the collector)."""
