// Command k8s-harness runs real Kubernetes components (built from the pinned modules) for the
// Python tests under tests/k8s: an API server, the scheduler's allocator and kubelet's DRA
// code, kube-controller-manager's device taint eviction controller, kube-scheduler. The same files build for every Kubernetes version: each version's module directory
// links them and adds compat.go for the few calls whose signatures differ.
package main

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strings"

	utilfeature "k8s.io/apiserver/pkg/util/feature"
)

func main() {
	if len(os.Args) < 2 {
		fail("usage: k8s-harness apiserver|allocate|kubelet|evict|scheduler [flags]")
	}
	var err error
	switch os.Args[1] {
	case "apiserver":
		err = runAPIServer(os.Args[2:])
	case "allocate":
		err = runAllocate(os.Args[2:])
	case "kubelet":
		err = runKubelet(os.Args[2:])
	case "evict":
		err = runEvict(os.Args[2:])
	case "scheduler":
		err = runScheduler(os.Args[2:])
	case "version":
		fmt.Println(kubernetesVersion)
	default:
		err = fmt.Errorf("unknown subcommand %q", os.Args[1])
	}
	if err != nil {
		fail(err.Error())
	}
}

// fail prints one JSON error line, so callers parse stdout the same way in every outcome.
func fail(message string) {
	emit(map[string]any{"error": message})
	os.Exit(2)
}

var stdout = json.NewEncoder(os.Stdout)

func emit(v any) {
	if err := stdout.Encode(v); err != nil {
		fmt.Fprintln(os.Stderr, "write stdout:", err)
		os.Exit(3)
	}
}

// setGates applies --feature-gates to the process-wide gate, which is what kubelet's DRA
// manager and the allocator's feature set read, exactly as in the real binaries.
func setGates(spec string) error {
	if strings.TrimSpace(spec) == "" {
		return nil
	}
	return utilfeature.DefaultMutableFeatureGate.Set(spec)
}

// freePort asks the kernel for a free loopback port; the window before the server binds it is
// small and a collision only fails that one start.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
