"""Which pod's container holds each GPU and MIG device, from kubelet's PodResources v1 API
(``--pod-resources-socket``), as dcgm-exporter labels its series with ``pod``, ``namespace``
and ``container``.

``holders`` is pure (kubelet's answer and the inventory in, labels per device out);
``poller`` asks kubelet once per collection interval, bounded, and keeps the last answer for
the metrics collector; ``client`` is the gRPC client, the only module here that needs the
``kubernetes`` extra (grpcio, protobuf)."""
