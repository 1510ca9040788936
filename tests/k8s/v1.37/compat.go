package main

// What differs between Kubernetes versions; every other file is shared (linked from ../src).

import (
	"context"

	v1 "k8s.io/api/core/v1"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
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

func nodeGetter(_ context.Context, get func(context.Context) (*v1.Node, error)) dra.GetNodeFunc {
	return get
}

func runPluginManager(ctx context.Context, pm pluginmanager.PluginManager, stop chan struct{}) {
	pm.Run(ctx, neverReady{}, stop)
}
