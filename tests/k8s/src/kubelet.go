package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	draplugin "k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

// command is one JSON line on stdin; each gets exactly one JSON line back, with "id" echoed
// so a caller may pipeline.
type command struct {
	ID       any      `json:"id,omitempty"`
	Op       string   `json:"op"`
	Driver   string   `json:"driver,omitempty"`
	Pod      string   `json:"pod,omitempty"`
	TimeoutS float64  `json:"timeout_s,omitempty"`
	Devices  []string `json:"devices,omitempty"`
	SpecDirs []string `json:"spec_dirs,omitempty"`
}

// kubeletHarness is kubelet's DRA manager and plugin manager, without the rest of kubelet:
// the plugin under test registers through the real watcher and is called through kubelet's
// own gRPC client.
type kubeletHarness struct {
	client  kubernetes.Interface
	manager *dra.Manager
	plugins *draplugin.DRAPluginManager

	mu       sync.Mutex
	prepared map[string]*v1.Pod // ns/name -> pod as prepared; unprepare works after the pod is gone
	// Pod UID -> how many times the DRA manager asked for the pod's status to be synced
	// because a device's health changed (its Updates channel, which kubelet's pod workers
	// read).
	healthUpdates map[string]int
}

func runKubelet(args []string) error {
	fs := flag.NewFlagSet("kubelet", flag.ExitOnError)
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig of the API server")
	registry := fs.String("registry-dir", "", "plugin registration directory kubelet watches")
	stateDir := fs.String("state-dir", "", "directory for the DRA manager's checkpoint")
	nodeName := fs.String("node-name", "", "this node's name")
	gates := fs.String("feature-gates", "", "kubelet --feature-gates")
	verbosity := fs.String("v", "0", "klog verbosity (logs go to stderr)")
	podResources := fs.String("pod-resources-socket", "", "serve kubelet's PodResources v1 API on this Unix socket (default: not served)")
	fs.Parse(args)
	if *kubeconfig == "" || *registry == "" || *stateDir == "" || *nodeName == "" {
		return fmt.Errorf("--kubeconfig, --registry-dir, --state-dir and --node-name are required")
	}
	if err := setGates(*gates); err != nil {
		return err
	}
	klogFlags := flag.NewFlagSet("klog", flag.ExitOnError)
	klog.InitFlags(klogFlags)
	klogFlags.Set("v", *verbosity)
	if err := os.MkdirAll(*registry, 0o750); err != nil {
		return err
	}
	if err := os.MkdirAll(*stateDir, 0o750); err != nil {
		return err
	}
	client, err := clientFromKubeconfig(*kubeconfig)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	logger := klog.Background()
	manager, err := dra.NewManager(logger, client, *stateDir)
	if err != nil {
		return err
	}
	h := &kubeletHarness{client: client, manager: manager, prepared: map[string]*v1.Pod{},
		healthUpdates: map[string]int{}}
	go h.countHealthUpdates(manager)
	getNode := func(ctx context.Context) (*v1.Node, error) {
		return client.CoreV1().Nodes().Get(ctx, *nodeName, metav1.GetOptions{})
	}
	// Sources never report ready, so the manager's reconcile loop never unprepares on its
	// own: every unprepare in a test is one the test asked for.
	if err := manager.Start(ctx, h.activePods, nodeGetter(ctx, getNode), neverReady{}); err != nil {
		return err
	}
	h.plugins = manager.GetWatcherHandler().(*draplugin.DRAPluginManager)
	pm := pluginmanager.NewPluginManager(*registry, &record.FakeRecorder{})
	pm.AddHandler(registerapi.DRAPlugin, manager.GetWatcherHandler())
	stop := make(chan struct{})
	go runPluginManager(ctx, pm, stop)
	defer close(stop)

	if *podResources != "" {
		server, err := h.servePodResources(ctx, *podResources)
		if err != nil {
			return err
		}
		defer server.Stop()
	}

	emit(map[string]any{"ready": true, "pid": os.Getpid(), "kubernetes": kubernetesVersion})
	lines := bufio.NewScanner(os.Stdin)
	lines.Buffer(make([]byte, 1<<20), 16<<20)
	for lines.Scan() {
		var cmd command
		if err := json.Unmarshal(lines.Bytes(), &cmd); err != nil {
			emit(map[string]any{"ok": false, "error": "bad command: " + err.Error()})
			continue
		}
		if cmd.Op == "exit" {
			emit(map[string]any{"id": cmd.ID, "ok": true})
			break
		}
		started := time.Now()
		answer, err := h.do(ctx, cmd)
		if answer == nil {
			answer = map[string]any{}
		}
		answer["id"], answer["ok"] = cmd.ID, err == nil
		answer["elapsed_us"] = time.Since(started).Microseconds()
		if err != nil {
			answer["error"] = err.Error()
		}
		emit(answer)
	}
	// EOF on stdin is the caller going away: close the plugin connections as kubelet's
	// shutdown does (what 1.37's Manager.Stop does; 1.34 has no Manager.Stop).
	h.plugins.Stop()
	return nil
}

func (h *kubeletHarness) do(ctx context.Context, cmd command) (map[string]any, error) {
	timeout := time.Duration(cmd.TimeoutS * float64(time.Second))
	if timeout <= 0 {
		timeout = 60 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	switch cmd.Op {
	case "wait-registered":
		return nil, h.waitRegistered(ctx, cmd.Driver)
	case "registered":
		_, err := h.plugins.GetPlugin(cmd.Driver)
		return map[string]any{"registered": err == nil}, nil
	case "prepare":
		return h.prepare(ctx, cmd.Pod)
	case "unprepare":
		return nil, h.unprepare(ctx, cmd.Pod)
	case "resource-health":
		return h.resourceHealth(ctx, cmd.Pod)
	case "cdi-inject":
		return injectCDI(cmd.Devices, cmd.SpecDirs)
	default:
		return nil, fmt.Errorf("unknown op %q", cmd.Op)
	}
}

func (h *kubeletHarness) waitRegistered(ctx context.Context, driver string) error {
	for {
		if _, err := h.plugins.GetPlugin(driver); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("driver %s not registered: %w", driver, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// prepare does what kubelet does before starting a pod's containers: PrepareResources, then
// the CDI device IDs each container gets (GetResources), which kubelet passes to the runtime.
func (h *kubeletHarness) prepare(ctx context.Context, ref string) (map[string]any, error) {
	pod, err := h.getPod(ctx, ref)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	h.prepared[ref] = pod
	h.mu.Unlock()
	if err := h.manager.PrepareResources(ctx, pod); err != nil {
		return nil, err
	}
	containers := map[string][]string{}
	for i := range pod.Spec.Containers {
		c := &pod.Spec.Containers[i]
		info, err := h.manager.GetResources(pod, c)
		if err != nil {
			return nil, err
		}
		ids := []string{}
		for _, d := range info.CDIDevices {
			ids = append(ids, d.Name)
		}
		containers[c.Name] = ids
	}
	return map[string]any{"containers": containers, "pod_uid": string(pod.UID)}, nil
}

func (h *kubeletHarness) unprepare(ctx context.Context, ref string) error {
	h.mu.Lock()
	pod := h.prepared[ref]
	h.mu.Unlock()
	if pod == nil {
		var err error
		if pod, err = h.getPod(ctx, ref); err != nil {
			return err
		}
	}
	if err := h.manager.UnprepareResources(ctx, pod); err != nil {
		return err
	}
	h.mu.Lock()
	delete(h.prepared, ref)
	h.mu.Unlock()
	return nil
}

// resourceHealth is what kubelet puts in a pod's status from its DRA health cache (the
// cache the plugin's health stream fills): as kubelet's status sync does, a container status
// per container, filled by the DRA manager's UpdateAllocatedResourcesStatus when the
// ResourceHealthStatus gate is on. Answers each container's allocatedResourcesStatus, whether
// the gate is on, and how many health-driven pod updates the manager sent for the pod.
func (h *kubeletHarness) resourceHealth(ctx context.Context, ref string) (map[string]any, error) {
	h.mu.Lock()
	pod := h.prepared[ref]
	h.mu.Unlock()
	if pod == nil {
		var err error
		if pod, err = h.getPod(ctx, ref); err != nil {
			return nil, err
		}
	}
	status := &v1.PodStatus{}
	for i := range pod.Spec.Containers {
		status.ContainerStatuses = append(status.ContainerStatuses,
			v1.ContainerStatus{Name: pod.Spec.Containers[i].Name})
	}
	gate := utilfeature.DefaultFeatureGate.Enabled(features.ResourceHealthStatus)
	if gate {
		updateAllocatedResourcesStatus(h.manager, pod, status)
	}
	containers := map[string][]v1.ResourceStatus{}
	for _, c := range status.ContainerStatuses {
		containers[c.Name] = c.AllocatedResourcesStatus
		if containers[c.Name] == nil {
			containers[c.Name] = []v1.ResourceStatus{}
		}
	}
	h.mu.Lock()
	updates := h.healthUpdates[string(pod.UID)]
	h.mu.Unlock()
	return map[string]any{"gate": gate, "containers": containers, "updates": updates}, nil
}

// countHealthUpdates reads the DRA manager's pod updates (kubelet's pod workers do) so the
// channel never fills, counting them per pod.
func (h *kubeletHarness) countHealthUpdates(manager *dra.Manager) {
	for update := range manager.Updates() {
		h.mu.Lock()
		for _, uid := range update.PodUIDs {
			h.healthUpdates[uid]++
		}
		h.mu.Unlock()
	}
}

func (h *kubeletHarness) getPod(ctx context.Context, ref string) (*v1.Pod, error) {
	ns, name, ok := strings.Cut(ref, "/")
	if !ok {
		return nil, fmt.Errorf("pod must be namespace/name, got %q", ref)
	}
	return h.client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
}

func (h *kubeletHarness) activePods() []*v1.Pod {
	h.mu.Lock()
	defer h.mu.Unlock()
	pods := make([]*v1.Pod, 0, len(h.prepared))
	for _, p := range h.prepared {
		pods = append(pods, p)
	}
	return pods
}

type neverReady struct{}

func (neverReady) AddSource(string) {}
func (neverReady) AllReady() bool   { return false }
