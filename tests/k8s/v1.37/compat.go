package main

// What differs between Kubernetes versions; every other file is shared (linked from ../src).

import (
	"context"

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

const kubernetesVersion = "1.37"

// allocatorFeatures mirrors how kube-scheduler 1.37 derives the allocator's features from its
// feature gates (dynamicresources plugin), so a gate passed here behaves as it would there.
func allocatorFeatures() structured.Features {
	on := utilfeature.DefaultFeatureGate.Enabled
	return structured.Features{
		AdminAccess:             on(features.DRAAdminAccess),
		PrioritizedList:         on(features.DRAPrioritizedList),
		PartitionableDevices:    on(features.DRAPartitionableDevices),
		DeviceTaints:            on(features.DRADeviceTaints),
		DeviceBindingAndStatus:  on(features.DRADeviceBindingConditions) && on(features.DRAResourceClaimDeviceStatus),
		ConsumableCapacity:      on(features.DRAConsumableCapacity),
		FractionalCapacityRange: on(features.DRAFractionalCapacityRange),
		ListTypeAttributes:      on(features.DRAListTypeAttributes),
		OptionalNodeOperations:  on(features.DRAOptionalNodeOperations),
		DerivedAttributes:       on(features.DRADerivedAttributes),
		CompatibilityGroups:     on(features.DRADeviceCompatibilityGroups),
	}
}

func celFeatures() cel.Features {
	on := utilfeature.DefaultFeatureGate.Enabled
	return cel.Features{
		EnableConsumableCapacity: on(features.DRAConsumableCapacity),
		EnableListTypeAttributes: on(features.DRAListTypeAttributes),
	}
}

// deviceTaintEvictionController builds the controller as kube-controller-manager 1.37 does
// (cmd/kube-controller-manager/app/resource.go): resource.k8s.io/v1 informers, DeviceTaintRules
// included, and a number of workers.
func deviceTaintEvictionController(client kubernetes.Interface, f informers.SharedInformerFactory,
	workers int) (func(context.Context), error) {
	c := devicetainteviction.New(client, f.Core().V1().Pods(), f.Resource().V1().ResourceClaims(),
		f.Resource().V1().ResourceSlices(), f.Resource().V1().DeviceTaintRules(),
		f.Resource().V1().DeviceClasses(), "device-taint-eviction-controller")
	return func(ctx context.Context) {
		if err := c.Run(ctx, workers); err != nil {
			klog.FromContext(ctx).Error(err, "Device taint eviction controller failed")
		}
	}, nil
}

func nodeGetter(_ context.Context, get func(context.Context) (*v1.Node, error)) dra.GetNodeFunc {
	return get
}

func runPluginManager(ctx context.Context, pm pluginmanager.PluginManager, stop chan struct{}) {
	pm.Run(ctx, neverReady{}, stop)
}

// PodResources providers with 1.37's signatures (loggers; CPUs and memory per pod too).
type noDevices struct{}

func (noDevices) UpdateAllocatedDevices(klog.Logger)                                   {}
func (noDevices) GetDevices(string, string) []*podresourcesv1.ContainerDevices         { return nil }
func (noDevices) GetAllocatableDevices(klog.Logger) []*podresourcesv1.ContainerDevices { return nil }

type noCPUs struct{}

func (noCPUs) GetCPUs(*v1.Pod, *v1.Container) []int64 { return nil }
func (noCPUs) GetPodCPUs(string) []int64              { return nil }
func (noCPUs) GetAllocatableCPUs() []int64            { return nil }

type noMemory struct{}

func (noMemory) GetMemory(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesv1.ContainerMemory {
	return nil
}
func (noMemory) GetPodMemory(klog.Logger, string) []*podresourcesv1.ContainerMemory { return nil }
func (noMemory) GetAllocatableMemory(klog.Logger) []*podresourcesv1.ContainerMemory { return nil }

type draResources struct{ h *kubeletHarness }

func (d draResources) GetDynamicResources(_ klog.Logger, pod *v1.Pod, c *v1.Container) []*podresourcesv1.DynamicResource {
	return d.h.dynamicResources(pod, c)
}

func podResourcesProviders(h *kubeletHarness) podresources.PodResourcesProviders {
	return podresources.PodResourcesProviders{Pods: h, Devices: noDevices{}, Cpus: noCPUs{},
		Memory: noMemory{}, DynamicResources: draResources{h}}
}

func setShareID(claimed *podresourcesv1.ClaimResource, device state.Device) {
	claimed.ShareId = (*string)(device.ShareID)
}

// The DRA manager's part of kubelet's pod status sync (1.37's takes a logger).
func updateAllocatedResourcesStatus(m *dra.Manager, pod *v1.Pod, status *v1.PodStatus) {
	m.UpdateAllocatedResourcesStatus(klog.Background(), pod, status)
}
