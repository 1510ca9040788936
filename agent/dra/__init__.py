"""Kubernetes DRA: this node's devices rendered as ``resource.k8s.io/v1`` ResourceSlices, the
pool generation kept across restarts, and the API server's rules the schema cannot say."""
