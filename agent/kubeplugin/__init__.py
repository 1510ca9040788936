"""``gpu-agent kubelet-plugin``: kubelet's DRA plugin for this node, a separate process that
reaches the agent only through its REST API on the Unix socket (never its modules), so the
agent stays the one owner of the GPUs and the plugin stays nearly stateless.

Importing this package loads nothing heavy: grpcio, protobuf and the Kubernetes client come
with the ``kubernetes`` extra and are imported by the modules that need them.
"""
