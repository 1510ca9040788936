package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// runAllocate runs the scheduler's structured allocator for one node. Inputs come either from
// JSON files (offline: no server needed) or from an API server, where the result is written
// back as the scheduler would: status.allocation plus reservedFor the pod.
func runAllocate(args []string) error {
	fs := flag.NewFlagSet("allocate", flag.ExitOnError)
	node := fs.String("node", "", "node name the claims are allocated for")
	gates := fs.String("feature-gates", "", "feature gates, as the scheduler's --feature-gates")
	slicesFile := fs.String("slices", "", "JSON file: ResourceSlices (a list or {items})")
	classesFile := fs.String("classes", "", "JSON file: DeviceClasses")
	claimsFile := fs.String("claims", "", "JSON file: claims to allocate, in order")
	allocatedFile := fs.String("allocated", "", "JSON file: claims already allocated (their devices are in use)")
	kubeconfig := fs.String("kubeconfig", "", "read everything from this API server instead")
	pod := fs.String("pod", "", "ns/name of the pod to reserve the claims for (with --kubeconfig)")
	var claimNames stringList
	fs.Var(&claimNames, "claim", "ns/name of a claim to allocate (with --kubeconfig; repeatable)")
	fs.Parse(args)
	if *node == "" {
		return fmt.Errorf("--node is required")
	}
	if err := setGates(*gates); err != nil {
		return err
	}
	ctx := context.Background()
	var in allocationInput
	var client kubernetes.Interface
	var err error
	if *kubeconfig != "" {
		client, err = clientFromKubeconfig(*kubeconfig)
		if err != nil {
			return err
		}
		in, err = inputFromServer(ctx, client, claimNames)
	} else {
		in, err = inputFromFiles(*slicesFile, *classesFile, *claimsFile, *allocatedFile)
	}
	if err != nil {
		return err
	}

	started := time.Now()
	results, err := allocate(ctx, *node, in)
	elapsed := time.Since(started)
	if err != nil {
		return err
	}
	if results == nil {
		emit(map[string]any{"allocated": false, "reason": "cannot allocate: no fit on node " + *node,
			"elapsed_us": elapsed.Microseconds()})
		return nil
	}
	answer := make([]map[string]any, len(results))
	for i := range results {
		claim := in.claims[i]
		answer[i] = map[string]any{"claim": claim.Namespace + "/" + claim.Name, "allocation": results[i]}
	}
	if client != nil {
		if *pod == "" {
			return fmt.Errorf("--pod is required with --kubeconfig")
		}
		if err := writeAllocations(ctx, client, *pod, in.claims, results); err != nil {
			return err
		}
	}
	emit(map[string]any{"allocated": true, "results": answer, "elapsed_us": elapsed.Microseconds()})
	return nil
}

type allocationInput struct {
	slices    []*resourceapi.ResourceSlice
	classes   []*resourceapi.DeviceClass
	claims    []*resourceapi.ResourceClaim
	allocated []*resourceapi.ResourceClaim
}

func allocate(ctx context.Context, nodeName string, in allocationInput) ([]resourceapi.AllocationResult, error) {
	features := allocatorFeatures()
	allocator, err := structured.NewAllocator(ctx, features, allocatedState(in.allocated, features.ConsumableCapacity),
		classLister(in.classes), in.slices, cel.NewCache(10, celFeatures()))
	if err != nil {
		return nil, err
	}
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}
	return allocator.Allocate(ctx, node, in.claims)
}

// allocatedState marks the devices of already allocated claims as taken, the way the
// scheduler's claim tracker does: admin access takes nothing, a share is tracked by its ID.
func allocatedState(claims []*resourceapi.ResourceClaim, consumable bool) structured.AllocatedState {
	state := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, claim := range claims {
		if claim.Status.Allocation == nil {
			continue
		}
		for _, r := range claim.Status.Allocation.Devices.Results {
			if ptr.Deref(r.AdminAccess, false) {
				continue
			}
			id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
			if consumable && r.ShareID != nil {
				state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
				if r.ConsumedCapacity != nil {
					state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, r.ConsumedCapacity))
				}
				continue
			}
			state.AllocatedDevices.Insert(id)
		}
	}
	return state
}

type classLister []*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) { return l, nil }

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	for _, c := range l {
		if c.Name == name {
			return c, nil
		}
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}

// readItems accepts a JSON list or a List object ({"items": [...]}), as kubectl and the
// agent's /v1/resourceslices write them.
func readItems[T any](path string) ([]*T, error) {
	if path == "" {
		return nil, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var list []*T
	if err := json.Unmarshal(data, &list); err != nil {
		var wrapped struct {
			Items []*T `json:"items"`
		}
		if err2 := json.Unmarshal(data, &wrapped); err2 != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		list = wrapped.Items
	}
	return list, nil
}

func inputFromFiles(slices, classes, claims, allocated string) (allocationInput, error) {
	var in allocationInput
	var err error
	if in.slices, err = readItems[resourceapi.ResourceSlice](slices); err != nil {
		return in, err
	}
	if in.classes, err = readItems[resourceapi.DeviceClass](classes); err != nil {
		return in, err
	}
	if in.claims, err = readItems[resourceapi.ResourceClaim](claims); err != nil {
		return in, err
	}
	if in.allocated, err = readItems[resourceapi.ResourceClaim](allocated); err != nil {
		return in, err
	}
	for _, c := range in.claims {
		if c.Namespace == "" {
			c.Namespace = "default"
		}
	}
	return in, nil
}

func inputFromServer(ctx context.Context, client kubernetes.Interface, names []string) (allocationInput, error) {
	var in allocationInput
	api := client.ResourceV1()
	slices, err := api.ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return in, err
	}
	classes, err := api.DeviceClasses().List(ctx, metav1.ListOptions{})
	if err != nil {
		return in, err
	}
	claims, err := api.ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return in, err
	}
	for i := range slices.Items {
		in.slices = append(in.slices, &slices.Items[i])
	}
	for i := range classes.Items {
		in.classes = append(in.classes, &classes.Items[i])
	}
	wanted := map[string]int{}
	for i, n := range names {
		wanted[n] = i
	}
	in.claims = make([]*resourceapi.ResourceClaim, len(names))
	for i := range claims.Items {
		c := &claims.Items[i]
		if at, ok := wanted[c.Namespace+"/"+c.Name]; ok {
			in.claims[at] = c
		} else if c.Status.Allocation != nil {
			in.allocated = append(in.allocated, c)
		}
	}
	for i, c := range in.claims {
		if c == nil {
			return in, fmt.Errorf("claim %s not found", names[i])
		}
		if c.Status.Allocation != nil {
			return in, fmt.Errorf("claim %s is already allocated", names[i])
		}
	}
	return in, nil
}

// writeAllocations records each result and the pod's reservation in one status update per
// claim, which is what the scheduler's PreBind does before the pod is bound.
func writeAllocations(ctx context.Context, client kubernetes.Interface, podName string,
	claims []*resourceapi.ResourceClaim, results []resourceapi.AllocationResult) error {
	ns, name, ok := strings.Cut(podName, "/")
	if !ok {
		return fmt.Errorf("--pod must be namespace/name")
	}
	pod, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for i, claim := range claims {
		c := claim.DeepCopy()
		c.Status.Allocation = &results[i]
		c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{
			Resource: "pods", Name: pod.Name, UID: pod.UID})
		if _, err := client.ResourceV1().ResourceClaims(c.Namespace).UpdateStatus(ctx, c, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("claim %s/%s: %w", c.Namespace, c.Name, err)
		}
	}
	return nil
}

func clientFromKubeconfig(path string) (kubernetes.Interface, error) {
	config, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, err
	}
	config.QPS, config.Burst = 200, 400 // a test drives bursts; client-side throttling only adds noise
	return kubernetes.NewForConfig(config)
}
