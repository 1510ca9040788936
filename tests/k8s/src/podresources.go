package main

// Kubelet's PodResources v1 server (pkg/kubelet/apis/podresources) on a Unix socket, as
// kubelet serves it (same rate limiter), backed by the harness: the pods it has prepared and
// are not yet unprepared are the active pods, and the real DRA manager's claim cache answers
// each container's dynamic resources, as kubelet's container manager does. Device plugins,
// CPUs and memory have no manager here: their providers answer nothing (compat.go, whose
// signatures differ between versions).

import (
	"context"
	"net"
	"os"
	"path/filepath"

	v1 "k8s.io/api/core/v1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"

	grpcserver "google.golang.org/grpc"
)

func (h *kubeletHarness) servePodResources(ctx context.Context, socket string) (*grpcserver.Server, error) {
	if err := os.MkdirAll(filepath.Dir(socket), 0o750); err != nil {
		return nil, err
	}
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return nil, err
	}
	server := grpcserver.NewServer(grpc.WithRateLimiter(ctx, "podresources",
		podresources.DefaultQPS, podresources.DefaultBurstTokens))
	podresourcesv1.RegisterPodResourcesListerServer(server,
		podresources.NewV1PodResourcesServer(ctx, podResourcesProviders(h)))
	go server.Serve(listener) //nolint:errcheck // ends with Stop at exit
	return server, nil
}

// The pods provider: what kubelet would list as active pods.
func (h *kubeletHarness) GetActivePods() []*v1.Pod { return h.activePods() }
func (h *kubeletHarness) GetPods() []*v1.Pod       { return h.activePods() }
func (h *kubeletHarness) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	pod, ok := h.prepared[namespace+"/"+name]
	return pod, ok
}

// dynamicResources is each container's claims as the DRA manager's cache holds them: per
// claim, every driver's devices with their pool, name and CDI IDs (what kubelet's container
// manager reports; a claim not in the cache is an empty answer there too).
func (h *kubeletHarness) dynamicResources(pod *v1.Pod, container *v1.Container) []*podresourcesv1.DynamicResource {
	infos, err := h.manager.GetContainerClaimInfos(pod, container)
	if err != nil {
		return []*podresourcesv1.DynamicResource{}
	}
	answer := make([]*podresourcesv1.DynamicResource, 0, len(infos))
	for _, info := range infos {
		resource := &podresourcesv1.DynamicResource{ClaimName: info.ClaimName, ClaimNamespace: info.Namespace}
		for driver, state := range info.DriverState {
			for _, device := range state.Devices {
				claimed := &podresourcesv1.ClaimResource{
					DriverName: driver, PoolName: device.PoolName, DeviceName: device.DeviceName,
				}
				setShareID(claimed, device)
				for _, id := range device.CDIDeviceIDs {
					claimed.CdiDevices = append(claimed.CdiDevices, &podresourcesv1.CDIDevice{Name: id})
				}
				resource.ClaimResources = append(resource.ClaimResources, claimed)
			}
		}
		answer = append(answer, resource)
	}
	return answer
}
