package main

// What differs between Kubernetes versions; every other file is shared (linked from ../src).

import (
	"context"
	"fmt"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/kubernetes/pkg/controller/devicetainteviction"

	v1 "k8s.io/api/core/v1"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra/state"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

const kubernetesVersion = "1.34"

// allocatorFeatures mirrors how kube-scheduler 1.34 derives the allocator's features from its
// feature gates (dynamicresources plugin), so a gate passed here behaves as it would there.
func allocatorFeatures() structured.Features {
	on := utilfeature.DefaultFeatureGate.Enabled
	return structured.Features{
		AdminAccess:          on(features.DRAAdminAccess),
		PrioritizedList:      on(features.DRAPrioritizedList),
		PartitionableDevices: on(features.DRAPartitionableDevices),
		DeviceTaints:         on(features.DRADeviceTaints),
		DeviceBinding:        on(features.DRADeviceBindingConditions),
		DeviceStatus:         on(features.DRAResourceClaimDeviceStatus),
		ConsumableCapacity:   on(features.DRAConsumableCapacity),
	}
}

func celFeatures() cel.Features {
	return cel.Features{EnableConsumableCapacity: utilfeature.DefaultFeatureGate.Enabled(features.DRAConsumableCapacity)}
}

// deviceTaintEvictionController builds the controller as kube-controller-manager 1.34 does
// (cmd/kube-controller-manager/app/core.go): DeviceTaintRules from resource.k8s.io/v1alpha3,
// which the server must serve (--runtime-config=resource.k8s.io/v1alpha3=true), or the
// controller's informers never sync; no worker count.
func deviceTaintEvictionController(client kubernetes.Interface, f informers.SharedInformerFactory,
	_ int) (func(context.Context), error) {
	c := devicetainteviction.New(client, f.Core().V1().Pods(), f.Resource().V1().ResourceClaims(),
		f.Resource().V1().ResourceSlices(), f.Resource().V1alpha3().DeviceTaintRules(),
		f.Resource().V1().DeviceClasses(), "device-taint-eviction-controller")
	return func(ctx context.Context) {
		if err := c.Run(ctx); err != nil {
			klog.FromContext(ctx).Error(err, "Device taint eviction controller failed")
		}
	}, nil
}

// 1.34's kubelet asks for the node without a context.
func nodeGetter(ctx context.Context, get func(context.Context) (*v1.Node, error)) dra.GetNodeFunc {
	return func() (*v1.Node, error) { return get(ctx) }
}

func runPluginManager(_ context.Context, pm pluginmanager.PluginManager, stop chan struct{}) {
	pm.Run(neverReady{}, stop)
}

// PodResources providers with 1.34's signatures (no loggers, CPUs and memory by pod UID).
type noDevices struct{}

func (noDevices) UpdateAllocatedDevices()                                      {}
func (noDevices) GetDevices(string, string) []*podresourcesv1.ContainerDevices { return nil }
func (noDevices) GetAllocatableDevices() []*podresourcesv1.ContainerDevices    { return nil }

type noCPUs struct{}

func (noCPUs) GetCPUs(string, string) []int64 { return nil }
func (noCPUs) GetAllocatableCPUs() []int64    { return nil }

type noMemory struct{}

func (noMemory) GetMemory(string, string) []*podresourcesv1.ContainerMemory { return nil }
func (noMemory) GetAllocatableMemory() []*podresourcesv1.ContainerMemory    { return nil }

type draResources struct{ h *kubeletHarness }

func (d draResources) GetDynamicResources(pod *v1.Pod, c *v1.Container) []*podresourcesv1.DynamicResource {
	return d.h.dynamicResources(pod, c)
}

func podResourcesProviders(h *kubeletHarness) podresources.PodResourcesProviders {
	return podresources.PodResourcesProviders{Pods: h, Devices: noDevices{}, Cpus: noCPUs{},
		Memory: noMemory{}, DynamicResources: draResources{h}}
}

// 1.34's DRA state and PodResources API have no share IDs.
func setShareID(*podresourcesv1.ClaimResource, state.Device) {}

// The DRA manager's part of kubelet's pod status sync (1.34's takes no logger).
func updateAllocatedResourcesStatus(m *dra.Manager, pod *v1.Pod, status *v1.PodStatus) {
	m.UpdateAllocatedResourcesStatus(pod, status)
}

// runScheduler: the scheduler subcommand is built for 1.37 only (src/scheduler.go); 1.34's
// kube-scheduler would add the k8s.io/kube-scheduler v0.34 module and minutes of cold build
// for placements the allocator subcommand already checks on 1.34.
func runScheduler([]string) error {
	return fmt.Errorf("the scheduler subcommand is built for Kubernetes 1.37 only")
}
