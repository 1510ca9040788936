"""``gpu-agent mps-host``: starts MPS control daemons outside the agent's cgroup
(``docs/sharing.md``, "Where daemons run"). A process of its own, reached over a Unix socket;
it imports only foundation modules and the launch seam (tests/test_layers.py)."""
